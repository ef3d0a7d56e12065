"""Incremental detokenization with the real SmolLM2 tokenizer on multi-byte text."""

from __future__ import annotations

import random
from typing import Any

import pytest
from server_fixtures import tokenizer_fixture  # noqa: F401 (fixture)

from eagleserve.server.detokenizer import IncrementalDetokenizer

PIECES = ["hello", " world", "😀", "🎉🚀", "你好", "世界", "日本語", "é", "ñ", "👩‍👩‍👧", " ", "\n",
          "Ω", "∑", "ß", "abc", "🇫🇷", "한국어", "—", "�x"]  # fmt: skip


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        deltas.append(detok.add(ids[i : i + k]))
        i += k
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("seed", range(40))
def test_never_splits_repeats_or_drops(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    text = random_text(rng, rng.randint(1, 30)).replace("�", "")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, rng)
    assert "".join(deltas) == text
    for d in deltas:
        assert "\ufffd" not in d  # no half characters handed out
        d.encode("utf-8")  # and nothing un-encodable (lone surrogates)


def test_one_token_at_a_time_emoji(tokenizer: Any) -> None:
    text = "a😀b你好🎉"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out = [detok.add([t]) for t in ids] + [detok.finish()]
    assert "".join(out) == text
    assert all("\ufffd" not in d for d in out)
    # A lone first byte of an emoji yields nothing until the character is complete.
    assert len(tokenizer.encode("😀", add_special_tokens=False)) > 1


def test_special_tokens_skipped(tokenizer: Any) -> None:
    ids = tokenizer.encode("hi 😀", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([t]) for t in ids) + detok.finish() == "hi 😀"


@pytest.mark.parametrize("seed", range(20))
def test_stop_string_cut_and_held_back(tokenizer: Any, seed: int) -> None:
    rng = random.Random(1000 + seed)
    stop = rng.choice(["世界", "STOP", "😀x", " world"])
    before = random_text(rng, rng.randint(0, 10))
    while stop in before or any(before.endswith(stop[:k]) for k in range(1, len(stop))):
        before = random_text(rng, rng.randint(0, 10))
    text = before + stop + random_text(rng, 5)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=[stop])
    deltas, i = [], 0
    while i < len(ids):
        deltas.append(detok.add(ids[i : i + 1]))
        i += 1
        # Nothing handed out may ever contain a (partial) stop string at its end.
        sent = "".join(deltas)
        assert stop not in sent
    deltas.append(detok.finish())
    assert "".join(deltas) == before
    assert detok.stopped


@pytest.mark.parametrize("seed", range(6))
def test_include_stop_str_keeps_the_stop_string_and_nothing_after(
    tokenizer: Any, seed: int
) -> None:
    rng = random.Random(2000 + seed)
    stop = rng.choice(["世界", "STOP", "😀x", " world"])
    before = random_text(rng, rng.randint(0, 10))
    while stop in before:
        before = random_text(rng, rng.randint(0, 10))
    ids = tokenizer.encode(before + stop + random_text(rng, 5), add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=[stop], include_stop_str=True)
    text = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert text == before + stop and detok.stopped


def test_holdback_released_when_not_a_stop(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["END"])
    out = detok.add(tokenizer.encode("the E", add_special_tokens=False))
    assert out == "the "  # "E" may start "END": held back
    out += detok.add(tokenizer.encode("xit", add_special_tokens=False))
    out += detok.finish()
    assert out == "the Exit"
    assert not detok.stopped


def test_finish_flushes_held_back_prefix(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["END"])
    ids = tokenizer.encode("ok EN", add_special_tokens=False)
    assert detok.add(ids) + detok.finish() == "ok EN"


@pytest.mark.parametrize("seed", range(6))
def test_min_tokens_ignores_stop_strings_in_the_first_tokens(tokenizer: Any, seed: int) -> None:
    """A stop string ending within the first min_tokens tokens does not count (the engine keeps
    generating there too); the first one ending later cuts, however the tokens arrive."""
    rng = random.Random(seed)
    words = [" one,", " two,", " three,", " four,", " five", ",", " six,", " seven"]
    text = "".join(words)
    ids = tokenizer.encode(text, add_special_tokens=False)
    min_tokens = rng.randint(1, len(ids) - 3)
    head = tokenizer.decode(ids[:min_tokens])
    want = text[: text.find(",", len(head))]
    detok = IncrementalDetokenizer(tokenizer, [","], min_tokens=min_tokens)
    assert "".join(stream(detok, ids, rng)) == want
    plain = IncrementalDetokenizer(tokenizer, [","])
    assert "".join(stream(plain, ids, rng)) == " one"
