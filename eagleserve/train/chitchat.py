"""More chat data: the BYU PCC Chit-Chat Challenge conversations (MIT license), shipped in the
PyPI wheel `chitchat-dataset` (fetched into the cache like ShareGPT, never committed).

7,168 open-domain human-human conversations (4,017 with both speakers, ~34 turns each); each
is a list of turns, a turn one or more consecutive messages of one speaker. The first speaker
becomes the user and the other the assistant, so they train as chat turns; they only ever join
the training side (the held-out split stays ShareGPT's, so held-out numbers compare across runs).
"""

from __future__ import annotations

import json

from eagleserve.train.wheels import wheel_file

CHITCHAT_WHEEL = "chitchat-dataset"
CHITCHAT_FILE = "dataset.json"


def chitchat_path() -> str:
    """Downloads (once) and unpacks the wheel; returns its dataset.json's path."""
    return wheel_file(CHITCHAT_WHEEL, CHITCHAT_FILE, subdir="chitchat")


def chitchat_conversations(path: str) -> list[list[dict[str, str]]]:
    """Every conversation as chat messages (a turn's messages joined by newlines), in file
    order; turns that are empty are dropped, conversations without an answer skipped."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out = []
    for conv in data.values():
        texts = ["\n".join(m["text"].strip() for m in turn if m.get("text", "").strip())
                 for turn in conv.get("messages") or []]  # fmt: skip
        texts = [t for t in texts if t]
        if len(texts) >= 2:
            out.append([{"role": ("user", "assistant")[i % 2], "content": t}
                        for i, t in enumerate(texts)])  # fmt: skip
    return out
