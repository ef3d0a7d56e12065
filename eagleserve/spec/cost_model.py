"""Start-up measurement of what a speculative decode iteration costs, on the device it runs on.

For each batch-size bucket and chain length k, one iteration is
- k = 0: a target decode (one token per request);
- k >= 1: (k - 1) head draft steps (the first draft comes from the last extend's seed), a
  target verify of k + 1 tokens per request (a tree: num_draft_tokens), and a head extend over
  up to k + 1 tokens.
Each part runs the way serving runs it: from its device graph where one is captured (the
target's decode and verify, a chain's draft step, loop and seed extend), else eagerly; eager
head steps on a GPU cost several times their graph, which would keep the controller from
drafting where drafting pays.
Each k's iteration is timed whole, its parts back to back as serving runs them, on dummy
requests (a context of up to CONTEXT tokens of scratch KV slots, freed afterwards) through the
same forwards serving uses, synchronized, best of a few repetitions. Timed one by one, each part
would meet the caches as the same part left them (a head extend after a head extend), not as
the part before it in an iteration does (a head extend after the target's verify has streamed
its weights through), and on a CPU the sum of such parts priced the longer chains well below
what serving's iterations cost. The table misses sampling and accept bookkeeping, which
`CostTable.observe` refines online.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eagleserve.device import synchronize
from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.cost_table import CostTable
from eagleserve.spec.draft_worker import EagleDraftWorker

CONTEXT = 128
REPEATS = 5
Key = tuple[str, int] | str


def _best_seconds(
    parts: dict[Key, Callable[[], object]], device: torch.device, repeats: int = REPEATS
) -> dict[Key, float]:
    """The fastest of `repeats` runs of each part, the parts interleaved run by run: the host's
    speed drifts (other tenants, clocks), and a drift while one part alone runs would skew
    the ratios between parts, which are what the controller compares."""
    for fn in parts.values():
        fn()  # warm-up
    best = dict.fromkeys(parts, float("inf"))
    for _ in range(repeats):
        for key, fn in parts.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def warm_up(runner: ModelRunner, drafter: EagleDraftWorker, choices: tuple[int, ...]) -> None:
    """Runs every part of an iteration once at batch size 1, untimed: where a stored table
    spares the timing, the kernels a first draft needs (the head's eager extend and steps, each
    verify shape) are still compiled at start-up, not mid-request at the first probe."""
    measure_costs(runner, drafter, (1,), choices, repeats=0)


def measure_costs(
    runner: ModelRunner,
    drafter: EagleDraftWorker,
    buckets: tuple[int, ...],
    choices: tuple[int, ...],
    repeats: int | None = None,
) -> CostTable:
    """Times every (bucket, k in choices) on scratch slots; the pools are as before afterwards.
    A tree (topk > 1) verifies num_draft_tokens per request and drafts topk per step."""
    spec = drafter.spec
    table = CostTable(buckets)
    r2t_pool, kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
    bs_max = max(buckets)
    max_new = max(spec.num_draft_tokens, spec.num_steps * spec.eagle_topk, spec.num_steps + 1)
    # A shorter context where the KV pool or a request's slot row is small (it only shifts
    # attention's share).
    max_context = r2t_pool.req_to_token.shape[1]
    width = min(CONTEXT + max_new, kv_pool.available_size() // bs_max, max_context)
    context = width - max_new
    if context < 1:
        raise ValueError(
            f"--max-total-tokens {kv_pool.size} and --context-length {max_context} leave no "
            f"context to measure speculation costs on: batches of {bs_max} need "
            f"{max_new + 1} KV slots each"
        )
    rows = [r2t_pool.alloc() for _ in range(bs_max)]
    loc = kv_pool.alloc(bs_max * width)
    try:
        assert loc is not None and all(r is not None for r in rows)
        rpi_all = torch.tensor(rows, dtype=torch.long, device=runner.device)
        r2t_pool.req_to_token[rpi_all, :width] = loc.view(bs_max, width)
        for bs in buckets:
            times = _part_times(runner, drafter, rpi_all[:bs], choices, context,
                                REPEATS if repeats is None else repeats)  # fmt: skip
            for k in choices:
                table.seconds[(bs, k)] = times["iteration", k] if k else times["verify", 1]
            # A catch-up extends a few held tokens per request: about the longest extend.
            table.catch_up[bs] = times["catch up"]
    finally:
        kv_pool.free(loc)
        for r in rows:
            if r is not None:
                r2t_pool.free(r)
    return table


def _part_times(
    runner: ModelRunner,
    drafter: EagleDraftWorker,
    rpi: torch.Tensor,
    choices: tuple[int, ...],
    context: int,
    repeats: int,
) -> dict[Key, float]:
    dev = runner.device
    bs = rpi.shape[0]
    r2t = runner.req_to_token_pool.req_to_token
    prefix = torch.full((bs,), context, dtype=torch.long, device=dev)
    hidden, feature = drafter.head.hidden_size, drafter.head.feature_size

    def fb(n: int, mode: str, kv_pool: object, backend: object) -> ForwardBatch:
        cols = context + torch.arange(n, device=dev)
        return ForwardBatch(
            mode=mode,  # type: ignore[arg-type]
            input_ids=torch.randint(0, runner.config.vocab_size, (bs * n,), device=dev),
            positions=cols.repeat(bs),
            out_cache_loc=r2t[rpi[:, None], cols[None, :]].reshape(-1),
            req_pool_indices=rpi,
            prefix_lens=prefix,
            extend_lens=torch.full((bs,), n, dtype=torch.long, device=dev),
            host=HostLens.per_request(n, context, bs),
            kv_pool=kv_pool,  # type: ignore[arg-type]
            attn_backend=backend,  # type: ignore[arg-type]
        )

    def draft_step(n: int) -> Callable[[], object]:
        """One head step of n rows per request, replayed from its graph where one serves it."""
        feats = torch.randn(bs * n, hidden, device=dev, dtype=runner.dtype)
        graph = drafter.graph

        def run() -> object:
            f = fb(n, "draft", drafter.kv_pool, drafter.attn_backend)
            with torch.inference_mode():
                if graph is not None and graph.can_replay(f):
                    return graph.replay(f, features=feats)
                with forward_context(f):
                    return drafter.head(f.input_ids, feats, f.positions)

        return run

    def draft_loop(k: int) -> Callable[[], object]:
        """The k-step draft as its loop graph replays it (drafter.draft)."""
        loop, topk = drafter.loop_graphs[k, "argmax"], drafter.spec.eagle_topk
        seed = (torch.rand(bs, topk, device=dev, dtype=runner.dtype),
                torch.randint(0, runner.config.vocab_size, (bs, topk), device=dev),
                torch.randn(bs, hidden, device=dev, dtype=runner.dtype))  # fmt: skip

        def run() -> object:
            f = fb(1, "draft", drafter.kv_pool, drafter.attn_backend)
            with torch.inference_mode():  # as serving drafts (EagleWorker's forward)
                return loop.replay(f, topk_p=seed[0], topk_index=seed[1], hidden=seed[2])

        return run

    def extend(n: int) -> Callable[[], object]:
        """The seed extend after a verify of n tokens per request (its graph where captured)."""
        feats = torch.randn(bs * n, feature, device=dev, dtype=runner.dtype)
        last_rows = torch.arange(1, bs + 1, device=dev) * n - 1

        def run() -> object:
            f = fb(n, "extend", drafter.kv_pool, drafter.attn_backend)
            with torch.inference_mode():
                return drafter.extend(f, feats, last_rows)

        return run

    spec = drafter.spec
    pieces: dict[Key, Callable[[], object]] = {}
    for n in {1} | {k + 1 if spec.is_chain else spec.num_draft_tokens for k in choices if k}:
        target_mode = "decode" if n == 1 else "verify"
        pieces["verify", n] = lambda n=n, m=target_mode: runner.forward(
            fb(n, m, runner.token_to_kv_pool, runner.attn_backend)
        )
    for k in choices:
        if k:
            pieces["extend", k + 1] = extend(k + 1)
        loop = drafter.loop_graphs.get((k, "argmax"))
        if loop is not None and bs <= loop.max_bs:
            pieces["draft loop", k] = draft_loop(k)
    # Tree branches run side by side (topk rows per request; the causal mask of this timing
    # costs about what the region mask does).
    pieces["draft"] = draft_step(spec.eagle_topk)

    def iteration(k: int) -> Callable[[], object]:
        """A depth-k iteration's parts back to back, as serving runs them: k - 1 head steps
        (one replay of the chain's loop graph where it has one), the verify, the extend."""
        steps = (
            [pieces["draft loop", k]]
            if ("draft loop", k) in pieces
            else [pieces["draft"]] * (k - 1)
        )
        verify = pieces["verify", k + 1 if spec.is_chain else spec.num_draft_tokens]
        extend_k = pieces["extend", k + 1]

        def run() -> object:
            for step in steps:
                step()
            verify()
            return extend_k()

        return run

    parts: dict[Key, Callable[[], object]] = {("verify", 1): pieces["verify", 1]}
    parts |= {("iteration", k): iteration(k) for k in choices if k}
    parts["catch up"] = pieces["extend", max(choices) + 1]
    times = _best_seconds(parts, dev, repeats)
    for k in choices:  # an iteration that drafts cannot cost less than a decode
        if k:
            times["iteration", k] = max(times["iteration", k], times["verify", 1])
    return times
