"""Prompt logprobs from the engine equal a plain transformers forward over the prompt (the first
token has none), with or without generation after them, target-only and with EAGLE heads, with
overlap on and off; `max_new_tokens` 0 scores the prompt and ends without a token."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TINY_VOCAB, random_prompts
from transformers import LlamaForCausalLM

from eagleserve.config import ModelConfig
from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.sampling.prompt_logprobs import ROWS_PER_CHUNK
from eagleserve.sampling_params import SamplingParams
from eagleserve.scheduler.scheduler import Scheduler
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

pytestmark = pytest.mark.usefixtures("torch_threads")


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    runner = ModelRunner(ModelConfig.from_dir(tiny_model_dir), tiny_model_dir,
                         torch.device("cpu"), torch.float32, 64, 1, 512)  # fmt: skip
    head = init_eagle_head("EAGLE", runner.model, seed=5)
    out = os.path.join(str(tmp_path_factory.mktemp("head")), "head")
    save_eagle_head(head, out)
    return out


def run(sched: Scheduler, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    """Per request: (prompt logprobs, prompt top logprobs, tokens, finish reason)."""
    outs: dict[str, list[TokenOutput]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        outs[f"r{i}"] = []
        sched.add_request(GenerateReqInput(f"r{i}", p, sp))
    done = 0
    while done < len(prompts) or sched.has_work():
        for o in sched.step():
            assert o.error is None, o.error
            outs[o.rid].append(o)
            done += o.finished
    result = []
    for i in range(len(prompts)):
        got = outs[f"r{i}"]
        scored = [o for o in got if o.prompt_logprobs is not None]
        assert len(scored) <= 1, "prompt logprobs come once"
        lp = scored[0].prompt_logprobs if scored else None
        tokens = [t for o in got for t in o.new_token_ids]
        result.append((lp and lp.logprobs, lp and lp.top, lp and lp.ranks, tokens,
                       got[-1].finish_reason))  # fmt: skip
    return result


SPEC = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=2,
            speculative_num_draft_tokens=5)  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("spec", [False, True], ids=["target", "eagle"])
def test_prompt_logprobs_equal_a_plain_forward(
    tiny_model_dir: str, head_dir: str, make_scheduler: Callable[..., Scheduler],
    spec: bool, overlap: bool,
) -> None:  # fmt: skip
    extra: dict[str, Any] = dict(SPEC, speculative_draft_model_path=head_dir) if spec else {}
    sched = make_scheduler(tiny_model_dir, disable_overlap_schedule=not overlap, **extra)
    seed = int(torch.randint(0, 2**31, (1,)))
    prompts = random_prompts(5, [1, 9, 23, 4, 40], seed=seed)
    params = [  # EOS ignored: the random model may pick it, and every request runs its length
        SamplingParams(max_new_tokens=0, temperature=0.0, prompt_logprobs=3),
        SamplingParams(max_new_tokens=0, temperature=0.0, prompt_logprobs=0),
        SamplingParams(max_new_tokens=6, temperature=0.0, prompt_logprobs=5, logprobs=2,
                       ignore_eos=True),
        SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),  # asks for none
        SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed, prompt_logprobs=1,
                       ignore_eos=True),
    ]  # fmt: skip
    got = run(sched, prompts, params)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    for (lps, tops, ranks, tokens, finish), prompt, p in zip(got, prompts, params):
        if p.prompt_logprobs is None:
            assert lps is None and len(tokens) == p.max_new_tokens
            continue
        assert len(tokens) == p.max_new_tokens and finish == "length"
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        want = [ref[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)]
        assert lps[0] is None and tops[0] == [] and len(lps) == len(prompt)
        assert lps[1:] == pytest.approx(want, abs=2e-4)
        assert ranks[0] is None and len(ranks) == len(prompt)
        for j, rank in enumerate(ranks[1:]):  # 1 + the tokens more likely (up to rounding)
            gap = ref[j] - ref[j, prompt[j + 1]]
            assert int((gap > 1e-3).sum()) + 1 <= rank <= int((gap > -1e-3).sum())  # itself in
        for j, top in enumerate(tops[1:]):
            vals, ids = ref[j].topk(p.prompt_logprobs)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=2e-4)


def test_long_prompts_are_scored_in_chunks(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler]
) -> None:
    """More rows than one chunk of logits, across two requests of one prefill."""
    sched = make_scheduler(tiny_model_dir, context_length=512)
    seed = int(torch.randint(0, 2**31, (1,)))
    prompts = random_prompts(2, [ROWS_PER_CHUNK - 7, 300], seed=seed, low=3)
    params = [SamplingParams(max_new_tokens=0, prompt_logprobs=1)] * 2
    got = run(sched, prompts, params)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    for (lps, _, _, tokens, _), prompt in zip(got, prompts):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        want = [ref[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)]
        assert tokens == [] and lps[1:] == pytest.approx(want, abs=2e-4)
    assert max(p for prompt in prompts for p in prompt) < TINY_VOCAB


def test_scored_prompts_bypass_the_prefix_cache_and_chunking(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler]
) -> None:
    """A prompt whose prefix is cached, longer than a prefill chunk, still gets every position."""
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=16)
    seed = int(torch.randint(0, 2**31, (1,)))
    (prompt,) = random_prompts(1, [70], seed=seed, low=3)
    run(sched, [prompt], [SamplingParams(max_new_tokens=2, temperature=0.0)])  # now cached
    (lps, _, _, _, _), (again, _, _, _, _) = run(
        sched, [prompt, prompt], [SamplingParams(max_new_tokens=0, prompt_logprobs=1)] * 2
    )
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    want = [ref[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)]
    for got in (lps, again):
        assert len(got) == len(prompt) and got[1:] == pytest.approx(want, abs=2e-4)
