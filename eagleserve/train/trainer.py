"""Training an EAGLE / EAGLE3 head on the target's own features (self-distillation).

Every batch is unrolled over `depths` draft depths (train/ttt.py): depth 0 reads the target's
features, depth s the head's own depth s-1 output, as the worker's draft steps do. Losses per
depth s, weighted 0.8**s: cross-entropy of the head's next-token logits against the target's
greedy token (answer positions only: the draft is only ever asked to continue an answer), plus
for EAGLE a smooth-L1 regression onto the target's next feature. Deterministic in the seed and
the step, so `--resume` reproduces an uninterrupted run.
"""

from __future__ import annotations

import functools
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from tqdm import tqdm

from eagleserve.device import empty_cache
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.head_loader import save_eagle_head
from eagleserve.train.batches import Batch, label_loss, sequence_batch
from eagleserve.train.features import IGNORE
from eagleserve.train.ttt import KV, head_step, lm_head_weight, padded_chain, prime_rotary


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str | None  # checkpoints go here; None: none written (the caller keeps the head)
    lr: float = 1e-3
    batch_size: int = 8
    max_len: int = 384
    epochs: float = 2  # fractional: the schedule ends part-way through the last epoch
    max_minutes: float = 60.0
    depths: int = 3  # unrolled draft depths per batch (1 = no training-time test)
    depth_decay: float = 0.8
    feature_weight: float = 1.0  # EAGLE only: smooth-L1 on next features
    ce_fraction: float = 0.5  # EAGLE only: rows whose full-vocab CE is computed (CPU cost)
    compute_dtype: str = "float32"  # "bfloat16": CPU autocast for the matmuls
    save_every: int = 100
    seed: int = 0
    max_steps: int | None = None  # stop early; --resume continues the same schedule
    soft_labels: bool = False  # CE against the target's top-k where a batch carries it
    # Wall-time budget in seconds (None: none). The schedule's length is estimated from the
    # measured step time after CALIBRATION_STEPS and re-estimated at every device wait, so the
    # cosine ends when the budget does.
    budget_s: float | None = None
    ttt_attention: str = "merge"  # train/ttt.py TTT_ATTENTION: how depths >= 1 attend
    # torch.compile the depth's forward and its loss (dynamic shapes: one graph per depth):
    # fuses the norms, rotary, activations and the soft-label loss's pointwise work.
    enable_torch_compile: bool = False


@dataclass
class Data:
    seqs: list[list[int]]
    prompt_lens: list[int]
    feats: list[torch.Tensor]  # [len, W] bf16, truncated to max_len
    label_map: torch.Tensor  # [target vocab] -> draft id or IGNORE


def _order(n: int, bsz: int, seed: int, epoch: int, lens: list[int]) -> list[list[int]]:
    """Batches of one epoch: shuffled, then length-sorted within chunks of 16 batches (less
    padding) and the batches shuffled again."""
    rng = random.Random(seed * 1000 + epoch)
    perm = list(range(n))
    rng.shuffle(perm)
    batches: list[list[int]] = []
    for c in range(0, n, bsz * 16):
        chunk = sorted(perm[c : c + bsz * 16], key=lambda i: lens[i])
        batches += [chunk[i : i + bsz] for i in range(0, len(chunk), bsz)]
    rng.shuffle(batches)
    return batches


class BatchSource(Protocol):
    """Batches of an epoch-based schedule: a pure function of (epoch, index within epoch)."""

    per_epoch: int

    def batch(self, epoch: int, within: int) -> Batch: ...


@dataclass
class MemorySource:
    """In-memory sequences (self-distilled data), batched as `_order` says."""

    data: Data
    cfg: TrainConfig

    def __post_init__(self) -> None:
        self.lens = [min(len(s), self.cfg.max_len) for s in self.data.seqs]
        self.per_epoch = math.ceil(len(self.lens) / self.cfg.batch_size)

    def batch(self, epoch: int, within: int) -> Batch:
        idx = _order(len(self.lens), self.cfg.batch_size, self.cfg.seed, epoch, self.lens)[within]
        return memory_batch(self.data, idx, self.cfg)


def memory_batch(data: Data, idx: list[int], cfg: TrainConfig) -> Batch:
    d = data
    return sequence_batch(d.seqs, d.prompt_lens, d.feats, d.label_map, idx, cfg.max_len, cfg.depths)


def labelled_rows(
    batch: Batch, depths: int, t: int, keep: list[torch.Tensor] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth s, the (batch row, label column) index pairs of the labelled positions of
    columns s+1 .. s+t, in row-major order (as boolean indexing orders them); `keep[s]` [B, t]
    masks them further. One selection for every depth: the step's one wait for the device."""
    valid = torch.stack([batch.y[:, s + 1 : s + 1 + t] != IGNORE for s in range(depths)])
    if keep is not None:
        valid &= torch.stack(keep)
    per_depth = valid.flatten(1).sum(1)  # queued before the read, so ready after it
    nz = valid.nonzero()  # [n, 3]: (depth, row, j), sorted; waits for the device
    counts: list[int] = per_depth.tolist()
    # Fresh tensors, not views of `nz` (a compiled loss guards on a view's offset: a recompile)
    return [(part[:, 1].clone(), part[:, 2] + s + 1) for s, part in enumerate(nz.split(counts))]


def depth_loss(
    hid: torch.Tensor,
    w: torch.Tensor,
    at: tuple[torch.Tensor, torch.Tensor],
    local_col: torch.Tensor,
    batch: Batch,
    soft: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accuracy) of one depth's hidden rows `hid` [B, t, h] at the labelled positions
    `at` (batch row, label column; `local_col` the column within `hid`)."""
    bi, col = at
    lab = batch.y[bi, col]
    logits = F.linear(hid[bi, local_col], w).float()
    term = label_loss(logits, batch, at, lab, soft)
    hits = (logits.argmax(-1) == lab).float()
    acc = hits.mean() if hits.shape[0] else torch.zeros((), device=hid.device)
    return term, acc


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def train_step(
    head: EagleHead, batch: Batch, cfg: TrainConfig, step: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, per-depth accuracy as 0-d device tensors). The only host read is the labelled
    rows' selection, once for all depths (EAGLE's feature loss reads its mask too): metrics stay
    on the device until the caller reads them."""
    x, f, fmask = batch.x, batch.f, batch.fmask
    t = f.shape[1] - cfg.depths - 1  # rows j: depth 0 needs x[j+1]
    w = lm_head_weight(head)
    keep = None
    if head.algorithm == "EAGLE":  # full-vocab CE on a random share of the rows
        gen = torch.Generator(device=x.device).manual_seed(cfg.seed * 1_000_003 + step)
        shape = (x.shape[0], t)
        keep = [torch.rand(shape, generator=gen, device=x.device) < cfg.ce_fraction
                for _ in range(cfg.depths)]  # fmt: skip
    rows = labelled_rows(batch, cfg.depths, t, keep)
    forward, loss_of = head_step, depth_loss
    if cfg.enable_torch_compile:
        forward, loss_of = _compiled(head_step), _compiled(depth_loss)
    feats = f[:, :t]
    past: list[list[KV]] = [[] for _ in range(head.config.num_hidden_layers)]  # per layer
    loss = torch.zeros((), device=x.device)
    metrics: dict[str, torch.Tensor] = {}
    # Compiled, the merge attention's depths >= 1 share one graph: their past padded to one
    # length (the last depth's), the padding masked.
    pad = cfg.enable_torch_compile and cfg.ttt_attention == "merge"
    if cfg.enable_torch_compile:
        prime_rotary(head, x.device)
    for s in range(cfg.depths):
        ids = x[:, s + 1 : s + 1 + t]
        pos = (torch.arange(t, device=x.device) + s).expand(x.shape[0], t)
        seen, valid = past, None
        if pad and s:
            padded = [padded_chain(p, cfg.depths - 1) for p in past]
            seen, valid = [p for p, _ in padded], padded[0][1]
        hid, out, kvs = forward(head, ids, feats, pos, seen, cfg.ttt_attention, valid)
        for p, kv in zip(past, kvs, strict=True):
            p.append(kv)
        bi, col = rows[s]
        term, metrics[f"acc{s}"] = loss_of(hid, w, (bi, col), col - (s + 1), batch,
                                           cfg.soft_labels)  # fmt: skip
        if head.algorithm == "EAGLE":
            fm = fmask[:, s + 1 : s + 1 + t]
            nxt = f[:, s + 1 : s + 1 + t]
            term = term + cfg.feature_weight * F.smooth_l1_loss(out[fm].float(), nxt[fm])
        loss = loss + cfg.depth_decay**s * term
        # One dtype at every depth >= 1 (a compiled step guards on it); the values are those the
        # next depth reads (it casts to its embedding dtype, exactly, from either).
        feats = out.to(f.dtype)
    return loss, metrics


def train_head(
    head: EagleHead, source: BatchSource, cfg: TrainConfig, start_state: dict | None = None
) -> dict[str, float]:
    """Trains in place, checkpointing to cfg.out_dir (if any); returns the last metrics (EMA)."""
    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    # One fused kernel per step on an accelerator; the CPU keeps the reference update, so CPU
    # runs reproduce heads trained before.
    fused = params[0].device.type != "cpu" or None
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95), fused=fused)
    per_epoch = source.per_epoch
    total = data_steps = math.ceil(per_epoch * cfg.epochs)
    warm = max(1, min(50, total // 20))
    step, ema = 0, {}
    if start_state is not None:
        opt.load_state_dict(start_state["optimizer"])
        step, ema = start_state["step"], start_state.get("metrics", {})
    dev_ema = {k: torch.tensor(v, device=params[0].device) for k, v in ema.items()}

    def lr_at(s: int) -> float:  # linear warm-up, cosine to 0: a pure function of the step
        return cfg.lr * min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s / total, 1)))

    dev = params[0].device.type
    autocast = torch.autocast(dev, torch.bfloat16, enabled=cfg.compute_dtype == "bfloat16")
    t0 = time.time()
    t_cal, first = 0.0, step
    rows = torch.zeros((), dtype=torch.long, device=params[0].device)  # real rows x depths
    bar = tqdm(total=total, initial=step, desc="Training head", unit="step")
    out_of_memory: str | None = None
    while step < total:
        epoch, within = divmod(step, per_epoch)
        batch = source.batch(epoch, within)
        try:
            with autocast:
                loss, m = train_step(head, batch, cfg, step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except torch.OutOfMemoryError as e:  # the steps done stay: the caller saves them
            out_of_memory = (f"out of device memory at step {step + 1}, a batch of "
                             f"{batch.x.shape[0]} windows x {batch.x.shape[1]} tokens "
                             f"({str(e).splitlines()[0]})")  # fmt: skip
            break
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
        step += 1
        rows += batch.fmask.sum() * cfg.depths
        m["loss"] = loss.detach()
        dev_ema = {k: v if k not in dev_ema else 0.95 * dev_ema[k] + 0.05 * v.detach()
                   for k, v in m.items()}  # fmt: skip
        elapsed = time.time() - t0
        stop = elapsed / 60 > cfg.max_minutes or step == cfg.max_steps
        stop = stop or (cfg.budget_s is not None and elapsed > cfg.budget_s)
        synced = step % POSTFIX_EVERY == 0
        if synced:  # reading the metrics waits for the device
            ema = {k: float(v) for k, v in dev_ema.items()}
            bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()})
            elapsed = time.time() - t0
        if cfg.budget_s is not None and not stop:
            measured = step - first - CALIBRATION_SKIP
            if measured == 0:
                t_cal = elapsed  # the first steps pay for warm-up (allocator, kernels)
            elif measured == CALIBRATION_STEPS or (measured > CALIBRATION_STEPS and synced):
                # Re-sized at every device wait, where the host's clock is the device's, from
                # all steps since the warm-up: batches differ in length, and a first estimate
                # taken while the host ran ahead of the device, or on a few long batches, would
                # end the schedule early or late.
                total = budget_steps(data_steps, step, elapsed, t_cal, measured, cfg.budget_s)
                bar.total = total
        save = step % cfg.save_every == 0 or step == total or stop  # the last step: metrics read
        if save and not synced:
            ema = {k: float(v) for k, v in dev_ema.items()}
        bar.update(1)
        if save and cfg.out_dir is not None:
            save_checkpoint(head, opt, step, ema, cfg.out_dir)
        if stop:
            break
    bar.close()
    stopped: dict[str, float] = {}
    if out_of_memory is not None:
        # Out of the except block: its traceback no longer holds the failed step's tensors;
        # its inputs (features: gigabytes on a GPU) and gradients go too.
        del batch
        opt.zero_grad(set_to_none=True)
        empty_cache(params[0].device)
        advice = "lower --batch-size or --max-len (the recipe's feature store: --store-gb)"
        if step == first:
            raise torch.OutOfMemoryError(f"{out_of_memory}: nothing trained; {advice}")
        print(f"{out_of_memory}: training stopped, the {step - first} steps done are kept; "
              f"{advice}", file=sys.stderr, flush=True)  # fmt: skip
        ema = {k: float(v) for k, v in dev_ema.items()}
        if cfg.out_dir is not None:
            save_checkpoint(head, opt, step, ema, cfg.out_dir)
        stopped = {"out_of_memory_at_step": float(step + 1)}
    n_rows = int(rows)
    speed = n_rows / max(1e-9, time.time() - t0)
    return {**ema, "steps": step, "total_steps": total, "token_depths_per_s": speed,
            "token_passes": n_rows / cfg.depths, **stopped}  # fmt: skip


POSTFIX_EVERY = 25  # steps between progress-bar metrics (each read waits for the device)
CALIBRATION_SKIP = 3
CALIBRATION_STEPS = 10


def budget_steps(
    total: int, step: int, elapsed: float, t_cal: float, measured: int, budget_s: float
) -> int:
    """The schedule length that ends within `budget_s` at the mean step time of the `measured`
    steps since `t_cal` (never longer than `total`, the data's length; never before `step`)."""
    per_step = max(1e-9, (elapsed - t_cal) / measured)
    return max(step + 1, min(total, step + int((budget_s - elapsed) / per_step)))


def save_checkpoint(
    head: EagleHead, opt: torch.optim.Optimizer, step: int, metrics: dict, out_dir: str
) -> None:
    """The head in the published format, plus fp32 weights, optimizer and step for --resume."""
    save_eagle_head(head, out_dir)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    torch.save(
        {"step": step, "optimizer": opt.state_dict(), "head": state, "metrics": metrics},
        os.path.join(out_dir, "trainer_state.pt"),
    )
