"""The head's extend: a forward over committed tokens whose last row per request seeds the next
draft, eager (`last_rows_forward`) or, after a verify on an accelerator, replayed from a device
graph (`DraftExtendGraphs`; SGLang's EAGLEDraftExtendCudaGraphRunner).

After a verify an accelerator keeps the extend at a fixed shape (spec/eagle_worker.py,
`AcceptedPaths.extend`): every request holds all `width` rows of its accepted path, a row past its
accept length writes its head K/V to slot 0 and seeds nothing (`mask_path_rows`; the graph
does the same on constants it holds: no launch from the host). That is a forward of `width`
tokens per request, the shape a graph replays; only the accept lengths vary, and they enter as
data. Eager, the same extend costs a hundred-odd small kernels launched from the host per
iteration.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal

import torch

from eagleserve.core import EagleDraftInput
from eagleserve.kernels import cpu_ext
from eagleserve.layers.attention import AttentionBackend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context
from eagleserve.mem_cache.kv_cache import TokenToKVPool
from eagleserve.model_executor.cuda_graph_runner import GraphedForward
from eagleserve.sampling.sampler import sample, sample_packed
from eagleserve.sampling.sampling_info import DrawKernel, PackedSampling, SamplingInfo
from eagleserve.spec.eagle_head import EagleHead

logger = logging.getLogger(__name__)


def last_rows_forward(
    head: EagleHead, fb: ForwardBatch, features: torch.Tensor, last_rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, next features) of each request's last row of the extend `fb` (`last_rows`, one
    per request), with every row's head KV written. On a one-layer head only the last rows run
    the whole layer (attention, MLP, lm_head): a draft starts from them, and the other rows' K/V
    depend on their own inputs alone, so they stop after the K/V projection; on a head of several
    layers every row runs every layer (the rows a path extend masked attend as any other, after
    the rows that count), the lm_head the last rows alone. Padding rows (out_cache_loc 0) may
    follow a request's last one, at position prefix_lens + extend_lens - 1. `last_rows` None:
    a fixed-shape path extend as the verify left it, masked first (`mask_path_rows`)."""
    if last_rows is None:
        fb, last_rows = mask_path_rows(fb)
        if head.upper_layers:  # their attention reads every row: all `width` of them count
            width = fb.host.max_extend
            fb = dataclasses.replace(fb, extend_lens=torch.full_like(fb.extend_lens, width),
                                     host=HostLens(width, fb.host.max_kv, True))  # fmt: skip
    # Layer 1's K/V read layer 0's attention: every row runs every layer. On the one-call CPU
    # layer, every row's K/V and the last rows' layer are one kernel call.
    if head.upper_layers or head.extends_in_one_call(fb):
        with forward_context(fb):
            return head(fb.input_ids, features, fb.positions, logit_rows=last_rows)
    if fb.input_ids.shape[0] == fb.batch_size:  # one row per request: all are last rows
        with forward_context(fb):
            return head(fb.input_ids, features, fb.positions)
    last = dataclasses.replace(
        fb,
        input_ids=fb.input_ids[last_rows],
        positions=fb.positions[last_rows],
        out_cache_loc=fb.out_cache_loc[last_rows],
        prefix_lens=fb.prefix_lens + fb.extend_lens - 1,
        extend_lens=torch.ones_like(fb.extend_lens),
        host=HostLens(1, fb.host.max_kv, True),
    )
    with forward_context(last):  # the fc too: its kernels are the forward's
        g = head.fused_features(features)
        head.write_kv(fb.input_ids, g, fb.positions, fb.out_cache_loc)
        return head(last.input_ids, g[last_rows], last.positions)


def mask_path_rows(fb: ForwardBatch) -> tuple[ForwardBatch, torch.Tensor]:
    """A fixed-shape path extend (`width` rows per request, `extend_lens` of them accepted) as
    it runs, and each request's last row: a row past its request's accept length gets token 0
    and KV slot 0 (never handed out), so it writes no K/V anyone reads. A batch already masked
    comes out the same."""
    width, bs = fb.host.max_extend, fb.batch_size
    a = fb.extend_lens
    step = torch.arange(width, device=a.device)
    valid = (step[None, :] < a[:, None]).reshape(-1)
    masked = dataclasses.replace(
        fb,
        input_ids=fb.input_ids.clamp(min=0),
        out_cache_loc=torch.where(valid, fb.out_cache_loc, 0),
    )
    return masked, torch.arange(bs, device=a.device) * width + a - 1


def top_candidates(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `topk` most likely draft ids of each row of head logits [rows, Vd] (any float dtype)
    and their fp32 probabilities, highest first. One candidate is the row's max: on a GPU one
    reduction, where a top-k select is a radix select several times its cost; on a tie, the
    lowest id."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if topk == 1:
        top_p, top_ids = probs.max(dim=-1, keepdim=True)
        return top_p, top_ids
    top_p, top_ids = probs.topk(topk, dim=-1)
    return top_p, top_ids


@dataclass(frozen=True)
class DraftDraw:
    """A chain's drafts for sampled requests: each drawn from the head's distribution by the
    rule and on the noise the target draws that position's token with (`sample`: the request's
    temperature, top-k, top-p and min-p over the draft vocabulary, then the exponential race on
    the exponentials of its seed, the position and each token's target id). A verify accepts a
    draft when it equals the target's own draw there; the race's winner among the tokens both
    distributions weigh alike is the same for both, so this drafts what the target then draws
    wherever the head's distribution matches the target's around it, where the head's argmax
    is accepted only with the target's probability of it. Greedy rows draft their argmax."""

    info: SamplingInfo  # one row per seed row
    positions: torch.Tensor  # [rows] int64: where each drafted token will sit

    @property
    def all_greedy(self) -> bool:
        return self.info.all_greedy

    def columns(self, logits: torch.Tensor, column_ids: torch.Tensor | None) -> torch.Tensor:
        """Each row's drawn column of `logits` (column_ids: their target ids)."""
        return sample(logits, self.info, self.positions, column_ids)

    def one_launch(self) -> PackedSampling | None:
        """The rows' parameters where one kernel draws them (`drawn_top1`: an accelerator's
        Triton draw, no row filtering by top-k or top-p); else None."""
        info = self.info
        if info.draw_kernel != "triton" or info.sorts:
            return None
        return info.packed()


# How a chain's drafts are chosen inside a device graph, one graph per mode: the head's argmax
# (every row greedy), or sampled rows drawn (`GraphDraftDraw`) with no row filtering by top-k or
# top-p, or with filters (a sort of each row).
DrawMode = Literal["argmax", "drawn", "drawn_filtered"]


def draw_mode(sampling: SamplingInfo | None) -> DrawMode:
    """The graph a batch with these sampling parameters drafts in."""
    if sampling is None or sampling.all_greedy:
        return "argmax"
    return "drawn_filtered" if sampling.sorts else "drawn"


@dataclass(frozen=True)
class GraphDraftDraw:
    """`DraftDraw` inside a device graph: the parameters are the graph's static inputs
    (`PackedSampling`), every row is drawn and a greedy row takes its argmax instead, nothing
    is read on the host. Each row drafts `DraftDraw`'s token (`sample_packed`)."""

    packed: PackedSampling
    positions: torch.Tensor
    filtered: bool  # a row may filter by top-k / top-p (DrawMode "drawn_filtered")
    kernel: DrawKernel | None

    all_greedy = False

    def columns(self, logits: torch.Tensor, column_ids: torch.Tensor | None) -> torch.Tensor:
        return sample_packed(logits, self.packed, self.positions, column_ids, self.filtered,
                             self.kernel)  # fmt: skip

    def one_launch(self) -> PackedSampling | None:
        return self.packed if self.kernel == "triton" and not self.filtered else None


def drawn_candidate(
    head: EagleHead, logits: torch.Tensor, draw: DraftDraw | GraphDraftDraw
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probability [rows, 1] fp32, target id [rows, 1]) of each row's `draw` from head logits
    [rows, Vd]: the race over the draft vocabulary, each token on the exponential the target's
    draw gives its target id (the tokens outside weigh zero for the head)."""
    columns = head.target_ids  # None: an EAGLE-1 head's vocabulary is the target's
    if columns is None and head.algorithm == "EAGLE3":
        columns = head.to_target_ids(torch.arange(logits.shape[1], device=logits.device))
    packed = draw.one_launch()
    if packed is not None:  # the draw, its probability and its target id in one kernel
        from eagleserve.kernels.triton_top1 import drawn_top1  # imports triton: only there

        return drawn_top1(logits, packed.floats, packed.ints, draw.positions, columns)
    ids = draw.columns(logits, columns)[:, None]
    x = logits.float()
    return (x.gather(1, ids) - x.logsumexp(dim=-1, keepdim=True)).exp(), head.to_target_ids(ids)


def seed_from_logits(
    head: EagleHead,
    logits: torch.Tensor,
    features: torch.Tensor,
    topk: int,
    draw: DraftDraw | GraphDraftDraw | None = None,
) -> EagleDraftInput:
    """The next draft's seed: the head's top-k (target ids) and the features it continues from;
    for a chain with sampled rows and `draw`, those rows' drawn drafts (`DraftDraw`). A
    chain's on a head on the fused kernels: one launch (kernels/triton_top1.py), on the
    one-call CPU layer one call (`cpu_ext.top1_rows`), the same ids."""
    if draw is not None and topk == 1 and not draw.all_greedy:
        topk_p, target_ids = drawn_candidate(head, logits, draw)
        return EagleDraftInput(topk_p, target_ids, features)
    if topk == 1 and head.fused_kernels and head.target_ids is not None:
        from eagleserve.kernels.triton_top1 import top1  # imports triton: only where it runs

        topk_p, target_ids = top1(logits, head.target_ids)
        return EagleDraftInput(topk_p, target_ids, features)
    cpu_top1 = head.cpu_layer is not None and logits.dtype == torch.float32
    if topk == 1 and cpu_top1 and head.target_ids is not None:
        # One call of the CPU kernels where a softmax, a max and a gather take three ops.
        topk_p, target_ids = cpu_ext.top1_rows(logits, head.target_ids)
        return EagleDraftInput(topk_p, target_ids, features)
    topk_p, topk_ids = top_candidates(logits, topk)
    return EagleDraftInput(topk_p, head.to_target_ids(topk_ids), features)


def draw_extras(mode: DrawMode) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A draft graph's static inputs for drafting in `mode`: none for the argmax, the
    `PackedSampling` of each row otherwise."""
    if mode == "argmax":
        return {}
    return {"draw_f": ((3,), torch.float32), "draw_i": ((3,), torch.long)}


def graph_draw(
    mode: DrawMode,
    extras: dict[str, torch.Tensor],
    rows: int,
    stride: int,
    positions: torch.Tensor,
    kernel: DrawKernel | None,
) -> GraphDraftDraw | None:
    """The draw of a graph captured for `mode` (None: the argmax) over its first `rows` rows:
    the packed parameters of every `stride`-th row of its extras (a request's first)."""
    if mode == "argmax":
        return None
    f, i = (extras[k][: rows * stride : stride] for k in ("draw_f", "draw_i"))
    return GraphDraftDraw(PackedSampling(f, i), positions, mode == "drawn_filtered", kernel)


class DraftExtendGraphs:
    """One device graph per path width (draft depth + 1) and draw mode of the seed extend after
    a verify: inputs the path rows (ids, positions, slots), the requests' slots and committed
    lengths, the target features, each row's request accept length and, for a drawn mode, its
    sampling parameters; outputs the seed (top-`topk` probabilities and target ids, next
    features) per request."""

    def __init__(
        self,
        head: EagleHead,
        kv_pool: TokenToKVPool,
        attn_backend: AttentionBackend,
        device: torch.device,
        widths: list[int],
        max_bs: int,
        dtype: torch.dtype,
        topk: int = 1,
        modes: tuple[DrawMode, ...] = ("argmax",),
        draw_kernel: DrawKernel | None = None,
    ) -> None:
        self.head, self.attn_backend, self.topk = head, attn_backend, topk
        self.draw_kernel = draw_kernel
        extras = {"features": ((head.feature_size,), dtype), "accept_lens": ((), torch.long)}
        # Constants of the row bookkeeping, made before any capture (a graph only reads them):
        # the path steps 0..width-1, each request's row before its path (b * width - 1), and
        # the last rows' extend lengths (one each).
        self.steps = {w: torch.arange(w, device=device) for w in widths}
        self.row_base = {w: torch.arange(max_bs, device=device) * w - 1 for w in widths}
        self.ones = torch.ones(max_bs, dtype=torch.long, device=device)
        self.graphs = {
            (w, mode): GraphedForward(
                lambda fb, ex, mode=mode: self.path_seed(fb, ex, mode),
                "extend",
                kv_pool,
                attn_backend,
                device,
                max_bs,
                w,
                extra_shapes=extras | draw_extras(mode),
                own_context=False,  # the write and the last rows each open their own
            )  # fmt: skip
            for w in widths
            for mode in modes
        }

    def capture(self) -> list[DrawMode]:
        """Captures every graph; returns the drawn modes whose capture failed, their graphs
        dropped (those batches extend in the argmax graphs). The argmax ones failing raises."""
        failed: list[DrawMode] = []
        for (_, mode), graph in self.graphs.items():
            if mode in failed:
                continue
            try:
                graph.capture()
            except Exception:
                if mode == "argmax":
                    raise
                logger.exception("capturing the %s seed extend failed: its batches extend in "
                                 "the argmax graphs", mode)  # fmt: skip
                failed.append(mode)
        self.graphs = {key: g for key, g in self.graphs.items() if key[1] not in failed}
        return failed

    def path_seed(
        self, fb: ForwardBatch, extras: dict[str, torch.Tensor], mode: DrawMode = "argmax"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`last_rows_forward` over a fixed-shape path extend (`width` rows per request) and
        its seed (drafted in `mode`), with nothing read from the host: the last rows come from
        the accept lengths on the device, and their attention metadata from the static buffers
        where the backend has them. A bucket's padding rows have accept length 0: taken as 1
        (slot 0, an empty prefix), so they read valid memory."""
        width, bs = fb.host.max_extend, fb.batch_size
        a = extras["accept_lens"].view(bs, width)[:, 0].clamp(min=1)
        # `mask_path_rows` on the constants: padding requests' rows hold slot 0 already; a
        # real request accepts at least 1.
        valid = (self.steps[width][None, :] < a[:, None]).reshape(-1)
        ids = fb.input_ids.clamp(min=0)
        loc = torch.where(valid, fb.out_cache_loc, 0)
        last_rows = self.row_base[width][:bs] + a
        kv_lens = fb.prefix_lens + a  # the last row's position is kv_lens - 1
        committed = kv_lens - 1
        static = hasattr(self.attn_backend, "init_forward_metadata_static")
        last = ForwardBatch(
            mode="draft",
            input_ids=ids[last_rows],
            positions=committed,
            out_cache_loc=loc[last_rows],
            req_pool_indices=fb.req_pool_indices,
            prefix_lens=committed,
            extend_lens=self.ones[:bs],
            host=HostLens(1, fb.host.max_kv, True),
            kv_pool=fb.kv_pool,
            attn_backend=self.attn_backend,
            kv_lens=kv_lens if static else None,
        )
        if static:
            self.attn_backend.init_forward_metadata_static(last)  # type: ignore[attr-defined]
        g = self.head.fused_features(extras["features"])
        with forward_context(last):
            self.head.write_kv(ids, g, fb.positions, loc)
            logits, next_feats = self.head(last.input_ids, g[last_rows], last.positions)
        # The last row's draft sits one past the row after it (as `extend` draws it).
        draw = graph_draw(mode, extras, bs, width, committed + 2, self.draw_kernel)
        seed = seed_from_logits(self.head, logits, next_feats, self.topk, draw)
        return seed.topk_p, seed.topk_index, seed.hidden_states

    def replay(
        self,
        fb: ForwardBatch,
        features: torch.Tensor,
        mode: DrawMode = "argmax",
        sampling: SamplingInfo | None = None,
    ) -> EagleDraftInput | None:
        """The seed of the path extend `fb` (the head's KV and backend), drafted in `mode`
        (a drawn one with the batch's `sampling`), or None when no graph computes it (another
        width or mode, a larger batch, rows not `width` per request). The seed is copied out:
        a later replay overwrites the graph's outputs."""
        width, bs = fb.host.max_extend, fb.batch_size
        graph = self.graphs.get((width, mode))
        if graph is None or not 0 < bs <= graph.max_bs or fb.input_ids.shape[0] != bs * width:
            return None
        accept_lens = fb.extend_lens.repeat_interleave(width)
        if mode == "argmax":
            out = graph.replay(fb, features=features, accept_lens=accept_lens)
        else:
            assert sampling is not None
            p = sampling.packed(width)
            out = graph.replay(fb, features=features, accept_lens=accept_lens, draw_f=p.floats,
                               draw_i=p.ints)  # fmt: skip
        topk_p, topk_index, hidden = (o[:bs].clone() for o in out)  # per request, not per row
        return EagleDraftInput(topk_p, topk_index, hidden)
