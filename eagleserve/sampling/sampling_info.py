"""A batch's sampling parameters on the device (SGLang's SamplingBatchInfo): temperature,
top-p, top-k, min-p and seed per row, which filters any row uses (known on the host), the
penalty state, and the views a verify and a device graph read (one row per draft node; two
packed tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import is_not
from typing import Literal

import torch

from eagleserve.core import Req, ScheduleBatch
from eagleserve.device import tensor_to
from eagleserve.sampling.penalty_state import BatchPenalties

# Where sampled rows draw in one fused call: "triton" (an accelerator's one launch,
# kernels/triton_sample.py) or "cpu" (the C++ call that also filters, from the logits:
# kernels/cpu_sample.cpp); None: torch ops.
DrawKernel = Literal["triton", "cpu"]


@dataclass
class SamplingInfo:
    temperatures: torch.Tensor  # [bs, 1] fp32 (1.0 for greedy rows, unused there)
    top_ps: torch.Tensor  # [bs]
    top_ks: torch.Tensor  # [bs] int64, vocab size when disabled
    min_ps: torch.Tensor  # [bs]
    is_greedy: list[bool]
    seeds: torch.Tensor  # [bs] int64: each sampled request's noise seed (0 on greedy rows)
    # Host-side: whether any row filters by top-k / top-p / min-p (no device read to find out).
    needs_top_k: bool = True
    needs_top_p: bool = True
    needs_min_p: bool = True
    # Rows with penalties or logit_bias (None: no row has any).
    penalties: BatchPenalties | None = None
    # The model runner's choice (model_runner.py `draw_kernel`).
    draw_kernel: DrawKernel | None = None
    # repeat_interleave's and packed's results by n: a batch's verifies and draft graphs reuse
    # them while its membership holds.
    _per_node: dict[int, SamplingInfo] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _packed: dict[int, PackedSampling] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def all_greedy(self) -> bool:
        return all(self.is_greedy)

    @property
    def sorts(self) -> bool:
        """Whether a row filters by top-k or top-p (its draw sorts its row)."""
        return self.needs_top_k or self.needs_top_p

    @classmethod
    def of_batch(
        cls, batch: ScheduleBatch, vocab_size: int, draw_kernel: DrawKernel | None
    ) -> SamplingInfo:
        """The batch's sampling info, rebuilt only when its requests changed (admission, finish,
        retraction). The cache holds the Req objects and compares them by identity: with an
        id() key, a request that joined in place of a finished one at the freed Req's address
        sampled with the old one's temperature, seed, penalties and bias."""
        reqs, cached = batch.reqs, batch.sampling_info
        if cached is None or len(cached[0]) != len(reqs) or any(map(is_not, cached[0], reqs)):
            prefilled = batch.batch_size - batch.decode_rows if batch.mode == "extend" else 0
            info = cls.from_reqs(batch.reqs, vocab_size, batch.device, prefilled, draw_kernel)
            batch.sampling_info = (tuple(reqs), info)
        return batch.sampling_info[1]

    @classmethod
    def from_reqs(
        cls,
        reqs: list[Req],
        vocab_size: int,
        device: torch.device,
        prefill_rows: int = 0,
        draw_kernel: DrawKernel | None = None,
    ) -> SamplingInfo:
        """The first `prefill_rows` requests are being prefilled (their penalty rows are reset
        from their host tokens); the others decode."""
        ps = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in ps]
        return cls(
            temperatures=tensor_to(
                [1.0 if g else p.temperature for p, g in zip(ps, greedy)], torch.float32, device
            ).view(-1, 1),
            top_ps=tensor_to([p.top_p for p in ps], torch.float32, device),
            top_ks=tensor_to(
                [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in ps],
                torch.int64,
                device,
            ),
            min_ps=tensor_to([p.min_p for p in ps], torch.float32, device),
            is_greedy=greedy,
            seeds=tensor_to([r.sampling_seed or 0 for r in reqs], torch.int64, device),
            needs_top_k=any(0 < p.top_k < vocab_size for p, g in zip(ps, greedy) if not g),
            needs_top_p=any(p.top_p < 1.0 for p, g in zip(ps, greedy) if not g),
            needs_min_p=any(p.min_p > 0 for p, g in zip(ps, greedy) if not g),
            penalties=BatchPenalties.of_reqs(reqs, vocab_size, device, prefill_rows),
            draw_kernel=draw_kernel,
        )

    def rows(self, rows: list[int], idx: torch.Tensor) -> SamplingInfo:
        """The info of a subset of the batch's rows, in the order given (`idx`: `rows` on the
        device), for logits that are already penalized (no penalties)."""
        return SamplingInfo(
            self.temperatures[idx],
            self.top_ps[idx],
            self.top_ks[idx],
            self.min_ps[idx],
            [self.is_greedy[i] for i in rows],
            self.seeds[idx],
            self.needs_top_k,
            self.needs_top_p,
            self.needs_min_p,
            draw_kernel=self.draw_kernel,
        )

    def repeat_interleave(self, n: int) -> SamplingInfo:
        """One row per draft node (verify): each request's parameters repeated n times, for
        logits that are already penalized (no penalties). Made once per n (no launches at the
        batch's later verifies)."""
        if n not in self._per_node:
            self._per_node[n] = self._repeated(n)
        return self._per_node[n]

    def packed(self, n: int = 1) -> PackedSampling:
        """The rows' parameters in two tensors, each row repeated n times (a graph's rows per
        request), made once per n."""
        if n not in self._packed:
            greedy = tensor_to(self.is_greedy, torch.bool, self.seeds.device)
            floats = torch.stack([self.temperatures[:, 0], self.top_ps, self.min_ps], dim=1)
            ints = torch.stack([self.top_ks, self.seeds, (~greedy).long()], dim=1)
            self._packed[n] = PackedSampling(
                floats.repeat_interleave(n, 0), ints.repeat_interleave(n, 0)
            )
        return self._packed[n]

    def _repeated(self, n: int) -> SamplingInfo:
        return SamplingInfo(
            self.temperatures.repeat_interleave(n, 0),
            self.top_ps.repeat_interleave(n),
            self.top_ks.repeat_interleave(n),
            self.min_ps.repeat_interleave(n),
            [g for g in self.is_greedy for _ in range(n)],
            self.seeds.repeat_interleave(n),
            self.needs_top_k,
            self.needs_top_p,
            self.needs_min_p,
            draw_kernel=self.draw_kernel,
        )


@dataclass(frozen=True)
class PackedSampling:
    """A batch's sampling parameters in two device tensors, one row each (a device graph's
    static inputs: two copies per replay where six tensors and a host list would not do)."""

    floats: torch.Tensor  # [rows, 3] fp32: temperature (1 on a greedy row), top_p, min_p
    ints: torch.Tensor  # [rows, 3] int64: top_k, seed, 1 on a sampled row and 0 on a greedy one
