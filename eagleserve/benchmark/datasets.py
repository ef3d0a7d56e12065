"""The serving benchmark's prompts (vLLM's data sets of the same names): `random` (random token
ids of given lengths), `sharegpt` (first turns of ShareGPT conversations, each asking for as many
tokens as its recorded answer has) and `custom` (a JSONL file of {"prompt": ...} lines)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

# vLLM's ShareGPT filter: prompts and answers of fewer tokens are dropped, and so are longer ones.
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str | list[int]  # text, or token ids (a completion's prompt can be ids)
    prompt_len: int  # its tokens as sent (a chat template adds its own)
    output_len: int  # max_tokens asked for


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """Lengths drawn uniformly from [mean * (1 - r), mean * (1 + r)] (vLLM's range ratio)."""
    if not 0 <= range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    return max(1, math.floor(mean * (1 - range_ratio))), math.ceil(mean * (1 + range_ratio))


def random_prompts(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    vocab_size: int,
    rng: random.Random,
) -> list[BenchPrompt]:
    """`n` prompts of random token ids: a shared prefix of `prefix_len` ids, then each its own
    input length (a prefix cache serves the prefix after the first)."""
    if vocab_size < 1:
        raise ValueError(
            "random prompts need the vocabulary size, which the server does not "
            "report (/get_model_info): use --dataset-name sharegpt or custom"
        )
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    prompts = []
    for _ in range(n):
        ids = prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(in_lo, in_hi))]
        prompts.append(BenchPrompt(ids, len(ids), rng.randint(out_lo, out_hi)))
    return prompts


def sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(first human turn, the answer to it) of each conversation in a ShareGPT JSON file."""
    from eagleserve.train.conversations import sharegpt_records

    pairs = []
    for rec in sharegpt_records(path):
        turns = rec.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human":
            prompt, answer = (turns[0].get("value") or "").strip(), turns[1].get("value") or ""
            if prompt and answer.strip():
                pairs.append((prompt, answer))
    return pairs


def sharegpt_prompts(
    pairs: list[tuple[str, str]],
    n: int,
    count_tokens: Callable[[str], int],
    max_context_len: int,
    output_len: int | None,
    rng: random.Random,
) -> list[BenchPrompt]:
    """`n` conversations drawn at random, each asking for its recorded answer's length (or
    `output_len`), within vLLM's bounds and the server's context; fewer if the file runs out."""
    order = list(range(len(pairs)))
    rng.shuffle(order)
    prompts: list[BenchPrompt] = []
    for i in order:
        if len(prompts) == n:
            break
        text, answer = pairs[i]
        prompt_len = count_tokens(text)
        out_len = output_len if output_len is not None else count_tokens(answer)
        if prompt_len < MIN_TOKENS or (output_len is None and out_len < MIN_TOKENS):
            continue
        total = prompt_len + out_len
        if prompt_len > MAX_PROMPT_TOKENS or total > min(MAX_TOTAL_TOKENS, max_context_len):
            continue
        prompts.append(BenchPrompt(text, prompt_len, out_len))
    return prompts


def custom_prompts(
    path: str, n: int, output_len: int, count_tokens: Callable[[str], int], rng: random.Random
) -> list[BenchPrompt]:
    """`n` prompts drawn from a JSONL file whose lines each hold a "prompt" string."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)["prompt"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'{path}:{lineno}: not a JSON object with a "prompt"') from None
            if not isinstance(prompt, str):
                raise ValueError(f'{path}:{lineno}: "prompt" is not a string')
            texts.append(prompt)
    if not texts:
        raise ValueError(f"{path} holds no prompt")
    rng.shuffle(texts)
    return [BenchPrompt(t, count_tokens(t), output_len) for t in texts[:n]]
