"""Converting a GGUF to an HF folder parses the file once: transformers' loader reads its header
for the config, the weights and the tokenizer, each parse walking the tokenizer's strings one
by one (loader.gguf_parsed_once). The converted default model itself is checked everywhere it
is used (tests/spec/test_recorded_tokens.py: its greedy tokens)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from eagleserve.models.loader import gguf_parsed_once

gguf = pytest.importorskip("gguf")


def _tiny_gguf(path: Path) -> str:
    rng = random.Random()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list([f"tok{i}" for i in range(rng.randrange(8, 32))])
    writer.add_tensor("token_embd.weight", np.random.rand(4, 8).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_one_reader_per_file_while_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[str] = []
    real = gguf.GGUFReader

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, path: str, mode: str = "r") -> None:
            parsed.append(path)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    a, b = _tiny_gguf(tmp_path / "a.gguf"), _tiny_gguf(tmp_path / "b.gguf")
    arch = gguf.MODEL_ARCH.LLAMA
    with gguf_parsed_once():
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(a) is first and gguf.GGUFReader(b) is not first
        assert first.fields["tokenizer.ggml.tokens"].data  # a real parse of the file
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert parsed == [a, b]
    assert gguf.GGUFReader is Counting  # each reader parses again outside the context
    assert gguf.GGUFReader(a) is not first
    assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 2)
