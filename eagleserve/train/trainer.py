"""Training an EAGLE-1/2 head on the target's own features (self-distillation).

Position j of a sequence pairs token x[j+1] with the target's final normed hidden state f[j]; the
head predicts f[j+1] (smooth L1) and, through the target's lm_head, x[j+2] (cross-entropy against
the target's own greedy token). A second, unrolled pass feeds the head its own predicted
features, as later draft steps do at inference ("training-time test"), so deep steps stay good.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from eagleserve.model.runner import ModelRunner
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.head_loader import save_eagle_head


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str
    lr: float = 1e-3
    batch_size: int = 8
    max_len: int = 384
    epochs: int = 2
    max_minutes: float = 60.0
    ttt_steps: int = 2  # forward passes per batch: 1 plain + unrolled ones on own features
    ce_weight: float = 0.1
    ce_fraction: float = 0.35  # share of positions whose 49k-way CE is computed (CPU cost)
    save_every: int = 100
    seed: int = 0
    max_steps: int | None = None  # stop early (a budget); --resume continues the same schedule


@torch.inference_mode()
def target_features(runner: ModelRunner, seqs: list[list[int]], max_len: int) -> list[torch.Tensor]:
    """Final normed hidden state of every position ([len, h] bf16 per sequence)."""
    feats = []
    r2t, kv = runner.req_to_token_pool, runner.token_to_kv_pool
    for s in tqdm(seqs, desc="Target features", unit="seq"):
        ids = torch.tensor(s[:max_len])
        n = len(ids)
        idx, loc = r2t.alloc(), kv.alloc(n)
        r2t.req_to_token[idx, :n] = loc
        out = runner.forward(
            "extend",
            ids,
            torch.arange(n),
            loc,
            torch.tensor([idx]),
            torch.tensor([0]),
            torch.tensor([n]),
            logits_indices=torch.tensor([n - 1]),
        )
        feats.append(out.hidden_states.to(torch.bfloat16))
        kv.free(loc)
        r2t.free(idx)
    return feats


def dense_head_forward(
    head: EagleHead, input_ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The EAGLE-1 head over whole sequences with plain causal attention (training only).

    input_ids [B, T], feats [B, T, h], positions [B, T] -> next features [B, T, h]. Same math
    as `EagleHead.forward` over the paged cache.
    """
    bsz, t = input_ids.shape
    layer = head.layers[0]
    attn = layer.self_attn
    emb = head.target.model.embed_tokens(input_ids)
    x = head.fc(torch.cat((emb, feats.to(emb.dtype)), dim=-1))  # [B, T, h]
    q = attn.q_proj(x).view(bsz * t, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(bsz * t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(bsz, t, attn.num_kv_heads, attn.head_dim)
    q, k = head.rotary_emb(positions.reshape(-1), q, k)
    q = q.view(bsz, t, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(bsz, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q, k, v.transpose(1, 2), is_causal=True, enable_gqa=attn.num_heads != attn.num_kv_heads
    )
    x = x + attn.o_proj(o.transpose(1, 2).reshape(bsz, t, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _batch(
    seqs: list[list[int]], feats: list[torch.Tensor], idx: list[int], max_len: int
) -> tuple[torch.Tensor, ...]:
    """Right-padded inputs/targets; `valid` marks positions with a next feature, `tok_valid`
    those with a next-next token."""
    n = min(max(len(seqs[i]) for i in idx), max_len) - 1
    bsz, h = len(idx), feats[idx[0]].shape[-1]
    ids = torch.zeros(bsz, n, dtype=torch.long)
    f_in = torch.zeros(bsz, n, h)
    f_next = torch.zeros(bsz, n, h)
    tok_next = torch.zeros(bsz, n, dtype=torch.long)
    valid = torch.zeros(bsz, n, dtype=torch.bool)
    tok_valid = torch.zeros(bsz, n, dtype=torch.bool)
    for b, i in enumerate(idx):
        s = torch.tensor(seqs[i][: n + 1])
        f = feats[i][: n + 1].float()
        m = len(s) - 1
        ids[b, :m] = s[1:]
        f_in[b, :m] = f[:-1]
        f_next[b, :m] = f[1:]
        valid[b, :m] = True
        tok_next[b, : m - 1] = s[2:]
        tok_valid[b, : m - 1] = True
    return ids, f_in, f_next, tok_next, valid, tok_valid


def train_head(
    head: EagleHead,
    seqs: list[list[int]],
    feats: list[torch.Tensor],
    cfg: TrainConfig,
    start_state: dict | None = None,
) -> dict[str, float]:
    """Trains in place; checkpoints to cfg.out_dir; returns the final metrics."""
    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    order = list(range(len(seqs)))
    steps_per_epoch = math.ceil(len(order) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    step = 0
    if start_state is not None:
        opt.load_state_dict(start_state["optimizer"])
        step = start_state["step"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s / total, 1)))
    )
    for _ in range(step):
        sched.step()
    t0 = time.time()
    metrics: dict[str, float] = {}
    bar = tqdm(total=total, initial=step, desc="Training head", unit="step")
    w = head.target.lm_head_weight.detach()
    while step < total:
        epoch, within = divmod(step, steps_per_epoch)
        rng = random.Random(cfg.seed + epoch)
        perm = order[:]
        rng.shuffle(perm)
        idx = perm[within * cfg.batch_size : (within + 1) * cfg.batch_size]
        ids, f_in, f_next, tok_next, valid, tok_valid = _batch(seqs, feats, idx, cfg.max_len)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        ce_pick = tok_valid & (torch.rand(tok_valid.shape, generator=gen) < cfg.ce_fraction)
        loss = torch.zeros(())
        feats_in = f_in
        for k in range(cfg.ttt_steps):
            out = dense_head_forward(head, ids, feats_in, positions)
            p_loss = F.smooth_l1_loss(out[valid], f_next[valid])
            logits = F.linear(out[ce_pick], w)
            ce = F.cross_entropy(logits, tok_next[ce_pick])
            loss = loss + (p_loss + cfg.ce_weight * ce) / (k + 1)
            metrics[f"acc{k}"] = float((logits.argmax(-1) == tok_next[ce_pick]).float().mean())
            # Next pass: position j sees the head's own prediction of f[j] (from j-1).
            feats_in = torch.cat([f_in[:, :1], out[:, :-1]], dim=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        step += 1
        metrics["loss"] = loss.item()
        bar.set_postfix(
            loss=f"{metrics['loss']:.3f}",
            acc=f"{metrics['acc0']:.3f}",
            acc_ttt=f"{metrics.get(f'acc{cfg.ttt_steps - 1}', 0):.3f}",
        )
        bar.update(1)
        if step % cfg.save_every == 0 or step == total:
            save_checkpoint(head, opt, step, cfg.out_dir)
        if (time.time() - t0) / 60 > cfg.max_minutes or step == cfg.max_steps:
            save_checkpoint(head, opt, step, cfg.out_dir)
            break
    bar.close()
    metrics["steps"] = step
    return metrics


def save_checkpoint(head: EagleHead, opt: torch.optim.Optimizer, step: int, out_dir: str) -> None:
    """The head in the published format, plus the optimizer and step for --resume."""
    save_eagle_head(head, out_dir)
    torch.save(
        {"step": step, "optimizer": opt.state_dict()}, os.path.join(out_dir, "trainer_state.pt")
    )
