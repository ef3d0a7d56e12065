"""A packed CPU target's linears are kept in the cache directory (models/weight_cache.py): a
second load maps them instead of reading and packing the GGUF, and gives the same weights and
tokens bit for bit; a changed key packs again; a truncated file is warned of and packed over."""

from __future__ import annotations

import glob
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, forward_tokens, save_tiny_model
from torch import nn

from eagleserve.config import ModelConfig
from eagleserve.kernels import cpu_ext
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.models import weight_cache
from eagleserve.models.gguf_weights import _BLOCK_NAMES, _GLOBAL_NAMES
from eagleserve.models.loader import iter_checkpoint
from eagleserve.models.quant import Int4Linear, Q8Int4Linear, pack_head_linears

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("torch_threads")
LOGGER = "eagleserve.models.weight_cache"
GGUF_NAMES = {hf: g for g, hf in _GLOBAL_NAMES.items()}
BLOCK_NAMES = {hf: g for g, hf in _BLOCK_NAMES.items()}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, *module, kind = hf.split(".")  # model.layers.N.self_attn.q_proj.weight
    return f"blk.{layer}.{BLOCK_NAMES['.'.join(module)]}.{kind}"


def write_gguf(model_dir: str, path: str) -> None:
    """The tiny model's weights as a GGUF: linears Q4_1, the untied head Q8_0, the rest F32."""
    writer = gguf.GGUFWriter(path, "llama")
    for name, tensor in iter_checkpoint(model_dir):
        arr = tensor.float().numpy()
        if name.endswith("proj.weight") or name == "lm_head.weight":
            qtype = gguf.GGMLQuantizationType.Q8_0 if name == "lm_head.weight" else (
                gguf.GGMLQuantizationType.Q4_1)  # fmt: skip
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tiny random Llama folder and its GGUF (fresh weights per run)."""
    cpu_ext.load()  # built (or found) in the user's cache, before the tests move the cache
    tmp = tmp_path_factory.mktemp("weight_cache")
    folder = str(tmp / "model")
    save_tiny_model(folder, seed=random.randrange(1 << 30))
    write_gguf(folder, str(tmp / "tiny.gguf"))
    return folder, str(tmp / "tiny.gguf")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache directory of this test's own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("EAGLESERVE_CACHE", str(root))
    yield root


def load(model: tuple[str, str]) -> ModelRunner:
    folder, path = model
    return ModelRunner(ModelConfig.from_dir(folder), folder, torch.device("cpu"),
                       torch.float32, 256, 1, 256, gguf_path=path)  # fmt: skip


def outcome(caplog: pytest.LogCaptureFixture) -> str:
    """What the last load did with the packed weights, from its INFO line."""
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and "start-up" in
             r.getMessage()]  # fmt: skip
    assert lines, "no start-up line about the packed weights"
    return "reused" if "reused" in lines[-1] else "packed"


def packed_tensors(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Every tensor a packed linear computes with: buffers, bias and the kernels' tiles."""
    out: dict[str, torch.Tensor] = {}
    for name, module in runner.model.named_modules():
        if isinstance(module, Int4Linear):  # Q8Int4Linear too
            out.update({f"{name}.{k}": v for k, v in module._buffers.items()})
            for i, tile in enumerate(module.blocked or ()):
                out[f"{name}.blocked{i}"] = tile
            if module.bias is not None:
                out[f"{name}.bias"] = module.bias
    return out


def greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after `prompt` and the prefill's logits."""
    n = len(prompt)
    loc = runner.token_to_kv_pool.alloc(n + steps)
    runner.req_to_token_pool.req_to_token[0, : n + steps] = loc
    zero = torch.tensor([0])
    out = forward_tokens(runner, "extend", torch.tensor(prompt), torch.arange(n), loc[:n],
                         zero, zero, torch.tensor([n]))  # fmt: skip
    prefill = out.logits.clone()
    tokens = [int(out.logits[-1].argmax())]
    for i in range(steps - 1):
        pos = torch.tensor([n + i])
        out = forward_tokens(runner, "decode", torch.tensor(tokens[-1:]), pos,
                             loc[n + i : n + i + 1], zero, pos, torch.tensor([1]))  # fmt: skip
        tokens.append(int(out.logits[-1].argmax()))
    runner.token_to_kv_pool.free(loc)
    return tokens, prefill


def test_second_load_reuses_the_packed_weights_bit_for_bit(
    model: tuple[str, str], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    cold = load(model)
    assert outcome(caplog) == "packed"
    assert len(glob.glob(str(cache / "packed" / "*.pt"))) == 1
    warm = load(model)
    assert outcome(caplog) == "reused"
    mods = dict(warm.model.named_modules())
    assert isinstance(mods["model.layers.0.self_attn.qkv_proj"], Int4Linear)  # fused, as cold
    assert "model.layers.0.self_attn.q_proj" not in mods
    assert isinstance(mods["lm_head"], Q8Int4Linear)
    a, b = packed_tensors(cold), packed_tensors(warm)
    assert sorted(a) == sorted(b) and len(a) > 0
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert (cold.model.cpu_layers is None) == (warm.model.cpu_layers is None)
    prompt = [random.randrange(TINY_VOCAB) for _ in range(random.randint(5, 12))]
    tokens_cold, logits_cold = greedy(cold, prompt, 8)
    tokens_warm, logits_warm = greedy(warm, prompt, 8)
    assert tokens_warm == tokens_cold
    assert torch.equal(logits_warm, logits_cold)


def test_a_changed_key_packs_again(
    model: tuple[str, str], cache: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger=LOGGER)
    load(model)
    assert outcome(caplog) == "packed"
    st = os.stat(model[1])  # the GGUF replaced or touched: its mtime changes
    os.utime(model[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    load(model)
    assert outcome(caplog) == "packed"
    load(model)
    assert outcome(caplog) == "reused"
    monkeypatch.setattr(weight_cache, "FORMAT", weight_cache.FORMAT + 1)  # a new layout
    load(model)
    assert outcome(caplog) == "packed"
    assert len(glob.glob(str(cache / "packed" / "*.pt"))) == 3


def test_a_truncated_file_is_warned_of_and_packed_over(
    model: tuple[str, str], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    cold = load(model)
    (path,) = glob.glob(str(cache / "packed" / "*.pt"))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # a write cut short (a crash, a full disk, a copy)
        f.truncate(random.randrange(size // 4, size - 1))
    caplog.clear()
    again = load(model)
    assert outcome(caplog) == "packed"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]
    assert warnings and path in warnings[0].getMessage()
    assert os.path.getsize(path) == size  # stored whole again
    a, b = packed_tensors(cold), packed_tensors(again)
    assert all(torch.equal(a[n], b[n]) for n in a)
    load(model)
    assert outcome(caplog) == "reused"


def test_a_draft_heads_packed_linears_are_reused_bit_for_bit(
    model: tuple[str, str], tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The head's 4-bit linears (pack_head_linears_cached): a second start reuses them, equal to
    a fresh packing; a changed source file packs again."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    head = tmp_path / "head"
    head.mkdir()
    (head / "model.safetensors").write_bytes(os.urandom(64))

    def build() -> nn.Module:
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 48, bias=False))
        weight_cache.pack_head_linears_cached(module, (str(head), model[1]))
        return module

    def said() -> str:
        return "reused" if "reused" in caplog.records[-1].getMessage() else "packed"

    seed = random.randrange(1 << 30)
    cold = build()
    assert said() == "packed"
    warm = build()
    assert said() == "reused"
    torch.manual_seed(seed)
    fresh = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 48, bias=False))
    pack_head_linears(fresh)
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(warm(x), fresh(x)) and torch.equal(cold(x), fresh(x))
    assert type(warm[0]) is type(fresh[0]) and not isinstance(warm[0], nn.Linear)
    st = os.stat(head / "model.safetensors")
    os.utime(head / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    build()
    assert said() == "packed"
