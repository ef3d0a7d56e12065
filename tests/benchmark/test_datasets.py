"""The serving benchmark's data sets: random prompts of the asked lengths with a shared prefix,
ShareGPT first turns within vLLM's bounds and the server's context, custom JSONL prompts."""

from __future__ import annotations

import json
import random

import pytest

from eagleserve.benchmark.datasets import (
    MAX_PROMPT_TOKENS,
    custom_prompts,
    random_prompts,
    sharegpt_pairs,
    sharegpt_prompts,
)


def words(text: str) -> int:
    return len(text.split())


def test_random_prompts_have_the_lengths_asked_for() -> None:
    rng = random.Random()
    vocab, n = rng.randint(100, 50000), rng.randint(5, 40)
    prefix, mean_in, mean_out, ratio = (
        rng.randint(0, 30),
        rng.randint(10, 300),
        rng.randint(4, 64),
        0.5,
    )
    prompts = random_prompts(
        n, mean_in, mean_out, ratio, prefix, vocab, random.Random(rng.random())
    )
    assert len(prompts) == n
    shared = prompts[0].prompt[:prefix]
    for p in prompts:
        assert isinstance(p.prompt, list) and p.prompt[:prefix] == shared
        assert all(0 <= t < vocab for t in p.prompt) and p.prompt_len == len(p.prompt)
        assert mean_in * 0.5 - 1 <= p.prompt_len - prefix <= mean_in * 1.5 + 1
        assert mean_out * 0.5 - 1 <= p.output_len <= mean_out * 1.5 + 1
    fixed = random_prompts(n, mean_in, mean_out, 0.0, 0, vocab, rng)
    assert {p.prompt_len for p in fixed} == {mean_in} and {p.output_len for p in fixed} == {
        mean_out
    }
    with pytest.raises(ValueError):
        random_prompts(1, 8, 8, 1.0, 0, vocab, rng)
    with pytest.raises(ValueError, match="--dataset-name sharegpt or custom"):
        random_prompts(1, 8, 8, 0.0, 0, 0, rng)  # a server that reports no vocabulary


def sharegpt_file(path, convs: list[list[tuple[str, str]]]) -> str:
    records = [{"id": str(i), "conversations": [{"from": f, "value": v} for f, v in c]}
               for i, c in enumerate(convs)]  # fmt: skip
    path.write_text(json.dumps(records))
    return str(path)


def test_sharegpt_prompts_keep_vllms_bounds(tmp_path) -> None:
    rng = random.Random()
    convs = []
    for _ in range(60):
        q = " ".join(["q"] * rng.choice([2, 8, 40, MAX_PROMPT_TOKENS + 5]))
        a = " ".join(["a"] * rng.choice([1, 16, 120, 1500]))
        convs.append([("human", q), ("gpt", a), ("human", "more")])
    convs.append([("gpt", "an answer first"), ("human", "is no prompt")])
    pairs = sharegpt_pairs(sharegpt_file(tmp_path / "sg.json", convs))
    assert len(pairs) == 60  # the conversation that starts with an answer is none
    ctx = rng.choice([256, 4096])
    prompts = sharegpt_prompts(pairs, 1000, words, ctx, None, rng)
    expected = [(q, a) for q, a in pairs if 4 <= words(q) <= MAX_PROMPT_TOKENS
                and words(a) >= 4 and words(q) + words(a) <= min(2048, ctx)]  # fmt: skip
    assert len(prompts) == len(expected) > 0
    assert sorted((p.prompt, p.output_len) for p in prompts) == sorted(
        (q, words(a)) for q, a in expected
    )
    few = sharegpt_prompts(pairs, 3, words, ctx, 7, rng)
    assert len(few) == 3 and {p.output_len for p in few} == {7}


def test_custom_prompts_and_their_errors(tmp_path) -> None:
    rng = random.Random()
    texts = [f"prompt {i} " + "x " * rng.randint(0, 9) for i in range(12)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts) + "\n")
    got = custom_prompts(str(path), 5, 33, words, rng)
    assert len(got) == 5 and {p.prompt for p in got} <= set(texts)
    assert all(p.output_len == 33 and p.prompt_len == words(p.prompt) for p in got)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        custom_prompts(str(bad), 5, 8, words, rng)
