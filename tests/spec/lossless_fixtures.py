"""test_eagle_lossless.py's tiny spec target (`target_dir`), its random EAGLE/EAGLE-3 heads
(`heads`, made by `save_random_head`), the prompts and params they run, `run_staggered`, the
target-only `reference` tokens, and `script_choices` (an adaptive controller's scripted chain
lengths); shared with the spec tests that check other paths against the same tokens (adaptive,
draft loop, GPU paths, prefix cache, chunked prefill, penalties, grammar, ...); and the
output-constraint tests' target with a one-character-per-token tokenizer (`char_target_dir`)
and its heads (`char_heads`)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import SPEC_VOCAB, _save_char_tokenizer, assert_kv_accounted, save_spec_target

from eagleserve import Engine, SamplingParams
from eagleserve.config import ModelConfig
from eagleserve.messages import GenerateReqInput
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

VOCAB = SPEC_VOCAB


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_spec_target(str(tmp_path_factory.mktemp("target")), 1234, VOCAB - 1, 0)


def save_random_head(
    target_dir: str, algorithm: str, tmp: str, quality: float, seed: int, layers: int = 1
) -> str:
    runner = ModelRunner(
        ModelConfig.from_dir(target_dir), target_dir, torch.device("cpu"), torch.float32, 64, 1, 512
    )
    draft_vocab = 48 if algorithm == "EAGLE3" else None
    head = init_eagle_head(algorithm, runner.model, draft_vocab_size=draft_vocab, seed=seed,
                           num_hidden_layers=layers)  # fmt: skip
    if algorithm == "EAGLE" and quality > 0:
        h = head.hidden_size
        with torch.no_grad():
            # fc passes the embedding of the newest token through: the head then guesses the
            # target's next token from the current one, which is mostly what the target does.
            head.fc.weight[:, :h].copy_(torch.eye(h) * quality + head.fc.weight[:, :h])
    out = os.path.join(tmp, f"{algorithm}-{quality}-{seed}-{layers}")
    save_eagle_head(head, out)
    return out


# name: (algorithm, quality, seed, layers) of the random heads the tests draft with.
HEADS = {
    "EAGLE": ("EAGLE", 1.0, 0, 1),
    "EAGLE-random": ("EAGLE", 0.0, 1, 1),
    "EAGLE3": ("EAGLE3", 0.0, 2, 1),
    # vLLM's multi-layer EAGLE3 layout: the midlayer, then a plain decoder layer.
    "EAGLE3-2layers": ("EAGLE3", 0.0, 3, 2),
}


def save_heads(target: str, tmp: str, names: list[str]) -> dict[str, str]:
    """The HEADS named, for `target`, saved under `tmp`: name -> folder."""
    out = {}
    for name in names:
        algorithm, quality, seed, layers = HEADS[name]
        out[name] = save_random_head(target, algorithm, tmp, quality, seed, layers)
    return out


@pytest.fixture(scope="module")
def heads(target_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return save_heads(target_dir, str(tmp_path_factory.mktemp("heads")), list(HEADS))


CHAR_VOCAB, CHAR_EOS = 256, 2


@pytest.fixture(scope="module")
def char_target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The spec target with a 256-token vocabulary, one character per token (output
    constraints read text), EOS 2."""
    path = save_spec_target(str(tmp_path_factory.mktemp("char_target")), 4321, CHAR_EOS, 1,
                            CHAR_VOCAB)  # fmt: skip
    _save_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def char_heads(char_target_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return save_heads(
        char_target_dir, str(tmp_path_factory.mktemp("char_heads")), ["EAGLE", "EAGLE3"]
    )


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 5, 40, 1, 9, 26, 12]
    return [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in lens]


def params() -> list[SamplingParams]:
    # Mixed finish conditions: long runs, short max_tokens, stop ids, ignore_eos.
    out = []
    for i in range(8):
        p = SamplingParams(max_new_tokens=[40, 7, 33, 12, 25, 3, 40, 18][i], temperature=0.0)
        if i == 2:
            p.stop_token_ids = [7, 11, 13]
        if i in (4, 6):
            p.ignore_eos = True
        out.append(p)
    return out


def sampled_batches(max_new_tokens: int = 10) -> list[tuple[str, list[SamplingParams]]]:
    """Two batches of three seeded requests for a chain's drawn drafts, each named by the draw
    mode of the draft graphs it runs in (spec/draft_extend.py `DrawMode`): sampling without
    filters beside a greedy row ("drawn"), and with top-p / top-k filters ("drawn_filtered")."""
    seed = lambda: int(torch.randint(0, 2**40, ()))  # noqa: E731
    base = dict(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [
        ("drawn", [SamplingParams(temperature=0.0, **base),
                   SamplingParams(temperature=1.0, seed=seed(), **base),
                   SamplingParams(temperature=0.7, min_p=0.05, seed=seed(), **base)]),
        ("drawn_filtered", [SamplingParams(temperature=0.8, top_p=0.9, seed=seed(), **base),
                            SamplingParams(temperature=1.2, top_k=20, seed=seed(), **base),
                            SamplingParams(temperature=0.0, **base)]),
    ]  # fmt: skip


def run_drafts_recorded(
    eng: Engine,
    prompts: list[list[int]],
    batches: list[tuple[str, list[SamplingParams]]],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each batch's output tokens (`prompts` under its params), and the draft tokens of every
    chain verify on the way, in order (what spec/tree.py `build_chain` was handed)."""
    from eagleserve.spec import draft_worker

    drafts: list[list[list[int]]] = []
    real_build = draft_worker.build_chain

    def record(bonus: torch.Tensor, draft_tokens: torch.Tensor, *rest: object) -> object:
        drafts.append(draft_tokens.tolist())
        return real_build(bonus, draft_tokens, *rest)

    with monkeypatch.context() as m:
        m.setattr(draft_worker, "build_chain", record)
        out = [o["token_ids"] for _, ps in batches for o in eng.generate(prompts, ps)]
    return out, drafts


def run_staggered(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    """Adds requests two at a time while others decode; returns each request's tokens."""
    sched = engine.scheduler
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    pending = list(enumerate(zip(prompts, params)))
    steps = 0
    while pending or len(finished) < len(prompts):
        if pending and steps % 2 == 0:
            for _ in range(2):
                if pending:
                    i, (p, sp) = pending.pop(0)
                    tokens[f"r{i}"] = []
                    sched.add_request(GenerateReqInput(f"r{i}", p, sp))
        for out in sched.step():
            assert out.error is None, out.error
            tokens[out.rid].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.rid)
        steps += 1
        assert steps < 5000
    while sched.has_work():
        assert not sched.step()
    assert_kv_accounted(sched)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(target_dir: str) -> list[list[int]]:
    eng = Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        disable_overlap_schedule=True,
    )
    return run_staggered(eng, prompts(0), params())


def script_choices(engine: Engine, choices: list[int]) -> None:
    """The controller picks k from `choices`, cycling: stretches without drafting (held head
    inputs), catch-ups, and every chain length."""
    controller = engine.scheduler.worker.controller
    assert controller is not None
    picks = iter(choices * 1000)
    controller.choose = lambda alphas, catching_up=False: next(picks)  # type: ignore[method-assign]
