"""The accelerator path of speculative decoding, run on a CPU before any GPU sees it: Triton
attention under the interpreter, device graphs through the stand-in of graph_standin.py (decode,
verify, draft steps, the draft loop, the seed extend), fixed-shape extends after a verify, host
reads refused inside every graph. Greedy output equals target-only's on the same kernels (run
eagerly, or replaying its own graphs), for EAGLE-1 and EAGLE-3, chains, a tree and adaptive
depth, overlap on and off. The seed extend
after a verify replays its own graph (spec/draft_extend.py), and what is left for the host to
launch per iteration stays small.

The same configurations run for real in tests/spec/test_gpu_paths.py on a GPU; this catches
what breaks the graph paths (a capture that cannot run, a host read, a stale static buffer)
without one."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import pytest
import torch

if torch.cuda.is_available():  # the real path runs there: tests/spec/test_gpu_paths.py
    pytest.skip("a CPU stand-in for a GPU's graphs", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton")

from graph_standin import ReplayCount, graphs_on_cpu, outside_replays  # noqa: E402
from lossless_fixtures import VOCAB, heads, script_choices, target_dir  # noqa: E402

from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.kernels import gemv_config  # noqa: E402
from eagleserve.messages import GenerateReqInput  # noqa: E402
from eagleserve.spec import cost_model  # noqa: E402

__all__ = ["heads", "target_dir"]  # module-scoped fixtures of lossless_fixtures

CHAIN3 = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
CASES = {
    "EAGLE3 chain 2, overlap": ("EAGLE3", dict(speculative_num_steps=2, speculative_eagle_topk=1,
                                               speculative_num_draft_tokens=3), True),
    "EAGLE tree 2x2/4": ("EAGLE", dict(speculative_num_steps=2, speculative_eagle_topk=2,
                                       speculative_num_draft_tokens=4), False),
    "EAGLE adaptive 0..3, overlap": ("EAGLE", dict(speculative_num_steps=3,
                                                   speculative_eagle_topk=1,
                                                   speculative_num_draft_tokens=4,
                                                   speculative_adaptive=True), True),
    # Two head layers: the path extend runs eagerly, every row through both layers.
    "EAGLE3 two layers, chain 3, overlap": ("EAGLE3-2layers", CHAIN3, True),
}  # fmt: skip


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReplayCount]:
    with graphs_on_cpu(monkeypatch) as count:
        yield count


def accelerator_engine(target_dir: str, overlap: bool, **spec: object) -> Engine:
    """An engine on the accelerator path (with the stand-in graphs open). Rows of 48 tokens
    unless `spec` says otherwise: every prompt here and its answer fit, and a start-up captures
    the prefill graphs of buckets 16 and 32 only (each bucket's capture is a forward under the
    interpreter)."""
    eng = Engine(model=target_dir, device="cpu", max_total_tokens=192, max_running_requests=3,
                 attention_backend="triton", disable_overlap_schedule=not overlap,
                 disable_radix_cache=True, **{"context_length": 48, **spec})  # fmt: skip
    worker = eng.scheduler.worker
    if hasattr(worker, "paths"):
        worker.paths.fixed_shape = True  # as on an accelerator: every path row runs
    return eng


def random_prompts(n: int) -> list[list[int]]:
    rng = random.Random()
    return [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_output_is_the_targets_on_the_graph_path(
    target_dir: str,
    heads: dict[str, str],
    graphs: ReplayCount,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    head, spec, overlap = CASES[case]
    # Adaptive times its cost table at start: once per part, as the interpreter is slow.
    monkeypatch.setattr(cost_model, "REPEATS", 1)
    prompts = random_prompts(3)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    # Target-only's tokens, eagerly: the spec engine's graphs against the eager path.
    want = accelerator_engine(target_dir, False, disable_cuda_graph=True).generate(prompts, params)
    eng = accelerator_engine(target_dir, overlap, speculative_algorithm=head.split("-")[0],
                             speculative_draft_model_path=heads[head], **spec)  # fmt: skip
    got = eng.generate(prompts, params)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    runner = eng.scheduler.worker.runner
    assert runner.graphs and any(graphs.of(g) for g in runner.graphs)  # verify replayed
    if spec["speculative_eagle_topk"] > 1:  # a tree drafts, and seeds its next draft, in graphs
        drafter = eng.scheduler.worker.drafter
        assert [graphs.of(g) > 0 for g in drafter.loop_graphs.values()] == [True]  # top-k only
        assert drafter.extend_graphs is not None
        assert [graphs.of(g) > 0 for g in drafter.extend_graphs.graphs.values()] == [True]
    if head.endswith("2layers"):  # drafts in the loop graph, extends eagerly
        drafter = eng.scheduler.worker.drafter
        assert drafter.extend_graphs is None
        assert graphs.of(drafter.loop_graphs[3, "argmax"]) > 0


def test_seed_extend_replays_its_graph_and_output_stays_the_targets(
    target_dir: str, heads: dict[str, str], graphs: ReplayCount
) -> None:
    prompts = random_prompts(3)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    want = accelerator_engine(target_dir, False, disable_cuda_graph=True).generate(prompts, params)
    eng = accelerator_engine(target_dir, False, speculative_algorithm="EAGLE",
                             speculative_draft_model_path=heads["EAGLE"], **CHAIN3)  # fmt: skip
    drafter = eng.scheduler.worker.drafter
    assert drafter.extend_graphs is not None and drafter.loop_graphs
    got = eng.generate(prompts, params)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert graphs.of(drafter.extend_graphs.graphs[4, "argmax"]) > 0
    assert graphs.of(drafter.loop_graphs[3, "argmax"]) > 0
    stats = eng.stats()
    assert stats.spec_accepted_tokens_total > 0  # the quality-1 head gets drafts accepted


TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)


@pytest.mark.parametrize("shape", ["chain 3", "tree 3x2/5"])
def test_the_greedy_acceptance_runs_in_the_verify_graph(
    target_dir: str, heads: dict[str, str], graphs: ReplayCount, shape: str
) -> None:
    """A verify graph also walks its greedy acceptance (packed_greedy; a tree's parents read
    off its mask): no argmax is launched from the host in a decode iteration. A batch mixing
    greedy and seeded sampled requests commits what the eager verify commits (the sampled rows
    are written over the graph's walk)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=heads["EAGLE3"],
                **(CHAIN3 if shape == "chain 3" else TREE))  # fmt: skip
    eng = accelerator_engine(target_dir, False, **spec)
    seed = random.randrange(2**31)
    plist = [
        SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=8, temperature=0.9, seed=seed, ignore_eos=True),
    ]
    prompts = random_prompts(2)
    host_ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not graphs.inside:
                host_ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    sched = eng.scheduler
    for i, ids in enumerate(prompts):
        sched.add_request(GenerateReqInput(f"g{i}", ids, plist[0]))
    while sched.has_work():
        decode = sched.running_batch is not None and not sched.waiting
        with Record() if decode else contextlib.nullcontext():
            sched.step()
    assert host_ops and "argmax" not in host_ops
    mixed = eng.generate(prompts, plist)
    eager = accelerator_engine(target_dir, False, disable_cuda_graph=True, **spec)
    assert [o["token_ids"] for o in mixed] == [
        o["token_ids"] for o in eager.generate(prompts, plist)
    ]


@pytest.mark.parametrize("shape", ["chain 3", "tree 3x2/5"])
def test_a_sampled_acceptance_runs_in_the_verify_graph(
    target_dir: str,
    heads: dict[str, str],
    graphs: ReplayCount,
    monkeypatch: pytest.MonkeyPatch,
    shape: str,
) -> None:
    """Seeded sampled requests filtering by neither top-k nor top-p, beside a greedy one: the
    verify graph walks their acceptance over the target's draws (accept.py `verify_walks`), so
    the host walks nothing; with a top-p request among them the host walks (the draw sorts).
    Every seed's output is target-only's either way."""
    from eagleserve.spec import accept as accept_mod

    walked_on_host: list[str] = []
    for name in ("verify_greedy_chain", "verify_greedy"):
        real = getattr(accept_mod, name)

        def record(*args, _real=real, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if not graphs.inside:
                walked_on_host.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(accept_mod, name, record)
    spec = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=heads["EAGLE"],
                **(CHAIN3 if shape == "chain 3" else TREE))  # fmt: skip
    eng = accelerator_engine(target_dir, False, **spec)
    target = accelerator_engine(target_dir, False)
    prompts = random_prompts(3)
    seeds = [random.randrange(2**31) for _ in prompts]
    base = dict(max_new_tokens=10, ignore_eos=True)
    unfiltered = [SamplingParams(temperature=0.0, **base),
                  SamplingParams(temperature=1.0, seed=seeds[1], **base),
                  SamplingParams(temperature=0.6, min_p=0.1, seed=seeds[2], **base)]  # fmt: skip
    filtered = [*unfiltered[:2], SamplingParams(temperature=0.6, top_p=0.8, seed=seeds[2], **base)]
    for params, host_walks in ((unfiltered, False), (filtered, True)):
        walked_on_host.clear()
        got = [o["token_ids"] for o in eng.generate(prompts, params)]
        assert bool(walked_on_host) == host_walks
        assert got == [o["token_ids"] for o in target.generate(prompts, params)]
    assert eng.stats().spec_accepted_tokens_total > 0


def _ops_per_iteration(eng: Engine, graphs: ReplayCount) -> float:
    """Ops dispatched outside graph replays per decode iteration of 2 requests: the median of
    enough iterations (a chain commits up to 4 tokens each) that the one where they finish
    (releases, batch filtering) is not it."""
    sched = eng.scheduler
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(random_prompts(2)):
        sched.add_request(GenerateReqInput(f"r{i}", ids, params))
    mode, tally = outside_replays(graphs)
    counts = []
    while sched.has_work():
        decode = sched.running_batch is not None and not sched.waiting
        before = tally["ops"]
        with mode():
            sched.step()
        if decode and len(sched.running_batch.reqs if sched.running_batch else []) == 2:
            counts.append(tally["ops"] - before)
    counts.sort()
    return counts[len(counts) // 2]


def test_a_chain_iteration_leaves_the_host_few_launches(
    target_dir: str, heads: dict[str, str], graphs: ReplayCount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph replay is one launch from the host; the ops around replays are each a launch (or
    host work) on an accelerator. With the seed extend in a graph, a chain-3 iteration
    dispatches a fraction of what it did with the extend eager."""
    spec = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=heads["EAGLE"],
                **CHAIN3)  # fmt: skip
    target_only = _ops_per_iteration(accelerator_engine(target_dir, False), graphs)
    graphed = _ops_per_iteration(accelerator_engine(target_dir, False, **spec), graphs)
    monkeypatch.setenv("EAGLESERVE_DISABLE_DRAFT_EXTEND_GRAPH", "1")
    eager = _ops_per_iteration(accelerator_engine(target_dir, False, **spec), graphs)
    print(f"ops outside replays per iteration: target-only {target_only}, chain 3 {graphed} "
          f"(eager extend {eager})")  # fmt: skip
    assert eager - graphed >= 50
    assert graphed <= 6 * target_only


def test_adaptive_at_k0_leaves_the_host_a_target_decodes_launches(
    target_dir: str, heads: dict[str, str], graphs: ReplayCount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped config drafts nothing where drafts do not pay: those iterations must cost
    what a plain decode costs, on the host as on the device."""
    monkeypatch.setattr(cost_model, "REPEATS", 1)  # the start-up cost table, as above
    target_only = _ops_per_iteration(accelerator_engine(target_dir, False), graphs)
    eng = accelerator_engine(target_dir, False, speculative_algorithm="EAGLE",
                             speculative_draft_model_path=heads["EAGLE"],
                             speculative_adaptive=True, **CHAIN3)  # fmt: skip
    script_choices(eng, [0])
    held = _ops_per_iteration(eng, graphs)
    print(f"ops outside replays per iteration: target-only {target_only}, adaptive at k = 0 {held}")
    assert held <= target_only + 6


def test_the_cost_table_times_what_serving_replays(
    target_dir: str, heads: dict[str, str], graphs: ReplayCount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adaptive controller compares the costs it timed at start: timed eagerly, a GPU's
    head steps and extends cost several times their graphs, and drafting never looks worth it.
    Every head forward of the timing runs inside a graph replay: draft step, loop, extend."""
    monkeypatch.setattr(cost_model, "REPEATS", 1)
    eng = accelerator_engine(target_dir, False, speculative_algorithm="EAGLE",
                             speculative_draft_model_path=heads["EAGLE"],
                             speculative_adaptive=True, **CHAIN3)  # fmt: skip
    worker = eng.scheduler.worker
    drafter = worker.drafter
    assert drafter.extend_graphs is not None
    # Greedy drafts' graphs (a sampled batch's cost the same, a few ops aside).
    timed = [
        g
        for (_, mode), g in [*drafter.loop_graphs.items(), *drafter.extend_graphs.graphs.items()]
        if mode == "argmax"
    ]
    before = [graphs.of(g) for g in timed]
    eager: list[int] = []
    head_forward = drafter.head.forward
    drafter.head.forward = lambda *a: (eager.append(0) if not graphs.inside else None,
                                       head_forward(*a))[1]  # fmt: skip
    table = cost_model.measure_costs(worker.runner, drafter, (1, 2), (0, 1, 2, 3), repeats=1)
    assert not eager
    assert all(graphs.of(g) > n for g, n in zip(timed, before, strict=True))
    assert sorted({k for k, _ in drafter.loop_graphs}) == [2, 3]
    assert sorted({w for w, _ in drafter.extend_graphs.graphs}) == [2, 3, 4]
    assert all(0 < s < float("inf") for s in table.seconds.values())


@pytest.mark.parametrize("spec", ["target-only", "EAGLE3 chain 3"])
def test_a_prefill_replays_its_graph_and_equals_the_eager_prefill(
    target_dir: str, heads: dict[str, str], graphs: ReplayCount, spec: str
) -> None:
    """A single request's prefill replays the prefill graph of its bucket (prompts of 1 to
    ~50 new tokens: buckets 16, 32 and 64; a prefix-cache hit pads only its new tokens) and
    gives the eager prefill's tokens and prompt logprobs; a batch of prefills runs eagerly."""
    extra = {} if spec == "target-only" else dict(
        speculative_algorithm="EAGLE3", speculative_draft_model_path=heads["EAGLE3"], **CHAIN3
    )  # fmt: skip

    def engine(**graphs_off: bool) -> Engine:
        eng = Engine(model=target_dir, device="cpu", max_total_tokens=192,
                     max_running_requests=3, attention_backend="triton",
                     disable_overlap_schedule=True, **extra, **graphs_off)  # fmt: skip
        if extra:
            eng.scheduler.worker.paths.fixed_shape = True  # as on an accelerator
        return eng

    rng = random.Random()
    rand = lambda n: [rng.randrange(1, VOCAB - 1) for _ in range(n)]  # noqa: E731
    system = rand(rng.randrange(20, 30))
    # Lengths drawn so that each of buckets 16 and 32 gets one prompt whatever the draw; the
    # system prompt + 5 (25-34 tokens) lands in 32 or 64.
    prompts = [rand(rng.randrange(1, 15)), rand(rng.randrange(17, 33)), system + rand(5),
               system + rand(rng.randrange(1, 9))]  # fmt: skip
    scored = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0)  # fmt: skip
    plain = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    graphed, eager = engine(), engine(disable_cuda_graph=True)  # nothing captured: all eager
    assert eager.scheduler.worker.runner.prefill_graphs is None
    runner = graphed.scheduler.worker.runner
    assert runner.prefill_graphs is not None and len(runner.prefill_graphs.graphs) >= 3
    # One at a time; scored prompts match no cached prefix, so the plain ones come last: the
    # system prompt is cached by then.
    runs = [(p, scored) for p in prompts] + [(p, plain) for p in prompts[2:]]
    got = [graphed.generate([p], params)[0] for p, params in runs]
    want = [eager.generate([p], params)[0] for p, params in runs]
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    for a, b in zip(got[: len(prompts)], want, strict=False):
        assert a["prompt_logprobs"][0] is None and b["prompt_logprobs"][0] is None
        assert a["prompt_logprobs"][1:] == pytest.approx(b["prompt_logprobs"][1:], abs=1e-4)
    replays = {n: graphs.of(g) for n, g in runner.prefill_graphs.graphs.items()}
    assert sum(replays.values()) == len(runs) and replays[16] and replays[32], replays
    assert graphed.stats().prefix_cache_hit_tokens_total >= len(system)
    before = sum(replays.values())
    together = graphed.generate(prompts[:2], plain)  # one prefill batch of two: eager
    assert sum(graphs.of(g) for g in runner.prefill_graphs.graphs.values()) == before
    assert [o["token_ids"] for o in together] == [o["token_ids"] for o in want[:2]]


@pytest.fixture
def wide_column_blocks() -> Iterator[None]:
    """Each GEMV launch's columns in one block: the interpreter runs a launch's programs one
    after another, and a row's bits do not depend on the column blocks (the kernels' own tests,
    tests/kernels/test_triton_gemv.py, run the blocks apart)."""
    with gemv_config.overriding(block_n=256):
        yield


@pytest.mark.parametrize("shape", ["chain 3", "tree 3x2/5"])
@pytest.mark.usefixtures("wide_column_blocks")
def test_eagle3_on_the_fused_kernels_gives_the_targets_tokens(
    target_dir: str,
    heads: dict[str, str],
    graphs: ReplayCount,
    monkeypatch: pytest.MonkeyPatch,
    shape: str,
) -> None:
    """A GPU's layout: the target's layers and the EAGLE3 head's on the fused Triton kernels
    (the GEMV ones for every forward here: their rows do not depend on the batch), inside the
    stand-in graphs, with overlap. Greedy output equals target-only's on the same kernels, the
    draft loop replaying its graph (tests/spec/test_fused_head.py checks the head's values); a
    tree's verify tree is built and walked by its kernels there."""
    from eagleserve.model_executor import model_runner
    from eagleserve.models import fused_forward

    monkeypatch.setattr(model_runner, "use_fused_kernels",
                        lambda device, backend, gguf, shard: backend == "triton")  # fmt: skip
    monkeypatch.setattr(fused_forward, "gemv_max_rows", lambda *args: 64)
    prompts = random_prompts(3)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    # The reference eager: the same kernels (a graph replays them).
    target = accelerator_engine(target_dir, False, disable_cuda_graph=True)
    assert target.scheduler.worker.runner.model.fused_kernels
    want = target.generate(prompts, params)
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=heads["EAGLE3"],
                **(CHAIN3 if shape == "chain 3" else TREE))  # fmt: skip
    eng = accelerator_engine(target_dir, True, **spec)
    drafter = eng.scheduler.worker.drafter
    assert drafter.head.fused_kernels and drafter.loop_graphs and drafter.extend_graphs
    got = eng.generate(prompts, params)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert graphs.of(drafter.loop_graphs[3, "argmax"]) > 0
    assert eng.stats().spec_verify_calls_total > 0
    # Not asserted: that drafts were accepted. The EAGLE3 head here is random (48 draft
    # tokens), so over these few verifies none may be; the walk kernels' accepting paths are
    # tested on planted walks (tests/kernels/test_triton_accept.py).
