"""load_tokenizer gives the tokenizer AutoTokenizer gives (its fast path for a folder that
names the generic fast class skips only AutoTokenizer's class resolution)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from conftest import _save_char_tokenizer
from transformers import AutoTokenizer

from eagleserve.models.loader import load_tokenizer


def random_text(rng: random.Random) -> str:
    words = ["hello", "world", "<|im_end|>", "é", "日本", "  ", "\n", '{"a": 1}', "123", "ab"]
    return "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(5, 40)))


def assert_same(path: str) -> None:
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)  # fmt: skip
    assert ours.chat_template == auto.chat_template
    assert ours.added_tokens_decoder.keys() == auto.added_tokens_decoder.keys()
    rng = random.Random()
    for _ in range(20):
        text = random_text(rng)
        ids = ours.encode(text)
        assert ids == auto.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(
            ids, skip_special_tokens=True)  # fmt: skip
    messages = [{"role": "user", "content": random_text(rng)}]
    if auto.chat_template is not None:
        assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(
            messages, tokenize=False)  # fmt: skip


def test_smollm2_tokenizer_is_autotokenizers(smollm2_dir: str) -> None:
    assert_same(smollm2_dir)


def test_a_saved_fast_tokenizer_is_autotokenizers(tmp_path: Path) -> None:
    _save_char_tokenizer(str(tmp_path))
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert_same(str(tmp_path))


def test_no_tokenizer_files_is_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path)) is None
