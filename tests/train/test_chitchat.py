"""The chit-chat wheel's conversations become alternating user/assistant chat turns, a turn's
consecutive messages joined, empty turns dropped, one-turn conversations skipped."""

from __future__ import annotations

import glob
import json
import os
import random

import pytest

from eagleserve.models.loader import cache_dir
from eagleserve.train.chitchat import chitchat_conversations


def test_turns_alternate_from_the_first_speaker(tmp_path) -> None:
    rng = random.Random()
    data, want = {}, []
    for c in range(6):
        turns = [[f"m{c}-{t}-{k}-{rng.random():.6f}" for k in range(rng.randint(1, 3))]
                 for t in range(rng.randint(1, 5))]  # fmt: skip
        data[f"id{c}"] = {"messages": [
            [{"text": f"  {m} ", "sender": f"s{t % 2}"} for m in turn] + [{"text": " "}]
            for t, turn in enumerate(turns)] + [[{"text": ""}]]}  # fmt: skip
        if len(turns) >= 2:
            want.append([{"role": ("user", "assistant")[t % 2], "content": "\n".join(turn)}
                         for t, turn in enumerate(turns)])  # fmt: skip
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps(data))
    assert chitchat_conversations(str(path)) == want


def test_the_wheels_file_parses() -> None:
    found = glob.glob(os.path.join(cache_dir(), "data", "chitchat", "**", "dataset.json"),
                      recursive=True)  # fmt: skip
    if not found:
        pytest.skip("chitchat-dataset wheel not fetched (train-draft --extra-conversations "
                    "chitchat fetches it)")  # fmt: skip
    convs = chitchat_conversations(found[0])
    assert 4000 <= len(convs) <= 4100  # of 7,168: the others have one speaker only
    assert all(m["content"] and m["role"] == ("user", "assistant")[i % 2]
               for c in convs for i, m in enumerate(c))  # fmt: skip
