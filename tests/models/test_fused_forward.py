"""The decoder layers on the fused Triton kernels (models/fused_forward.py) equal the unfused
torch layers: logits, hidden and aux states and the KV cache, over prefill, decode and extend,
Llama (GQA, Llama-3 rope) and Qwen2 (q/k/v bias), fp32 and bf16; with the small-batch GEMV
kernels (kernels/triton_gemv.py) and without, and greedy decoding gives the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from conftest import forward_tokens  # noqa: E402

from eagleserve.config import ModelConfig  # noqa: E402
from eagleserve.kernels import gemv_config  # noqa: E402
from eagleserve.model_executor.model_runner import ModelRunner, use_fused_kernels  # noqa: E402
from eagleserve.models.fused_forward import enable_fused_kernels, use_gemv  # noqa: E402

AUX = (0, 2)


def runner(path: str, dtype: torch.dtype, fused: bool, gemv_rows: int = 16) -> ModelRunner:
    r = ModelRunner(ModelConfig.from_dir(path), path, DEVICE, dtype, 96, 4, 64, "triton",
                    aux_layer_ids=AUX, fused_kernels=fused)  # fmt: skip
    if fused and not r.model.fused_kernels:  # a CPU host: set up as the runner does on a GPU
        enable_fused_kernels(r.model, DEVICE)
    assert r.model.fused_kernels == fused
    r.model.fused_gemv_max_rows = gemv_rows  # 0: the per-op fused kernels at every size
    return r


def tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: the fused kernels round where the torch ops round, except rotary's products and sum
    # (one rounding instead of three); a few layers turn that into a few bf16 steps.
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}


@pytest.mark.parametrize("gemv_rows", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_fused_layers_match_unfused(
    model: str, dtype: torch.dtype, gemv_rows: int, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(model)
    runners = [runner(path, dtype, fused, gemv_rows) for fused in (False, True)]
    gen = torch.Generator().manual_seed(5)
    lens = [9, 5]
    steps = [
        ("extend", [0, 0], lens),
        ("decode", lens, [1, 1]),
        ("decode", [n + 1 for n in lens], [1, 1]),
        ("extend", [n + 2 for n in lens], [3, 3]),
    ]
    slots = (torch.randperm(95, generator=gen) + 1)[: 2 * 20]  # slot 0 is the padding slot
    rows = torch.tensor([2, 0])
    for r in runners:
        r.req_to_token_pool.req_to_token[rows] = 0
        r.req_to_token_pool.req_to_token[rows, :20] = slots.view(2, 20).to(DEVICE)
    for mode, prefix, extend in steps:
        # gemv_rows 16: every step (14 rows at most) takes the GEMV kernels; 0: none does.
        assert use_gemv(runners[1].model, sum(extend), dtype) == (gemv_rows > 0)
        ids = torch.randint(3, 256, (sum(extend),), generator=gen).to(DEVICE)
        pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend, strict=True)])
        spans = enumerate(zip(prefix, extend, strict=True))
        loc = torch.cat([slots.view(2, 20)[i, p : p + e] for i, (p, e) in spans])
        outs = [
            forward_tokens(r, mode, ids, pos.to(DEVICE), loc.to(DEVICE), rows.to(DEVICE),
                           torch.tensor(prefix, device=DEVICE), torch.tensor(extend, device=DEVICE))
            for r in runners
        ]  # fmt: skip
        ref, got = outs
        torch.testing.assert_close(got.logits, ref.logits, **tol(dtype))
        torch.testing.assert_close(got.hidden_states, ref.hidden_states, **tol(dtype))
        assert ref.aux_hidden_states is not None and got.aux_hidden_states is not None
        torch.testing.assert_close(got.aux_hidden_states, ref.aux_hidden_states, **tol(dtype))
    pools = [r.token_to_kv_pool for r in runners]
    for layer in range(len(pools[0].k_buffer)):
        for name in ("k_buffer", "v_buffer"):
            a, b = (getattr(p, name)[layer][slots.to(DEVICE)] for p in pools)
            torch.testing.assert_close(b, a, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_decode_gives_the_unfused_greedy_tokens(
    tiny_model_dir: str, dtype: torch.dtype
) -> None:
    """Three requests prefilled, then greedy decode steps fed back: the same tokens on the GEMV
    kernels (batch 3 <= the threshold) as on the unfused torch layers."""
    runners = [runner(tiny_model_dir, dtype, fused) for fused in (False, True)]
    assert use_gemv(runners[1].model, 3, dtype)
    gen = torch.Generator().manual_seed(11)
    bs, prompt, new = 3, 6, 6
    slots = (torch.randperm(95, generator=gen) + 1)[: bs * (prompt + new)].view(bs, -1)
    rows = torch.tensor([1, 3, 0])
    for r in runners:
        r.req_to_token_pool.req_to_token[rows, : prompt + new] = slots.to(DEVICE)
    prompts = torch.randint(3, 256, (bs, prompt), generator=gen)
    tokens = []
    for r in runners:
        out = forward_tokens(r, "extend", prompts.flatten().to(DEVICE),
                             torch.arange(prompt).repeat(bs).to(DEVICE),
                             slots[:, :prompt].flatten().to(DEVICE), rows.to(DEVICE),
                             torch.zeros(bs, dtype=torch.long, device=DEVICE),
                             torch.full((bs,), prompt, device=DEVICE))  # fmt: skip
        last = out.logits.view(bs, prompt, -1)[:, -1].argmax(-1)
        seq = [last]
        for step in range(new - 1):
            pos = prompt + step
            # slots[:, pos] is a strided column: the kernels read out_cache_loc by its stride.
            out = forward_tokens(r, "decode", last, torch.full((bs,), pos, device=DEVICE),
                                 slots[:, pos].to(DEVICE), rows.to(DEVICE),
                                 torch.full((bs,), pos, device=DEVICE),
                                 torch.ones(bs, dtype=torch.long, device=DEVICE))  # fmt: skip
            last = out.logits.argmax(-1)
            seq.append(last)
        tokens.append(torch.stack(seq, 1).tolist())
    assert tokens[1] == tokens[0]


def test_gemv_at_every_size_in_the_batch_invariant_mode(tiny_model_dir: str) -> None:
    r = runner(tiny_model_dir, torch.float32, True, gemv_rows=0)
    assert r.model.gemv_capable
    assert not use_gemv(r.model, 1, torch.float32)  # off by default outside the mode
    r.model.fused_gemv_max_rows = 16
    assert use_gemv(r.model, 16, torch.float32) and not use_gemv(r.model, 17, torch.float32)
    r.model.batch_invariant = True  # as make_batch_invariant sets it
    assert use_gemv(r.model, 1, torch.float32) and use_gemv(r.model, 4096, torch.float32)
    r.model.gemv_capable = False  # a large model: the batch-invariant GEMM at every size
    assert not use_gemv(r.model, 1, torch.float32)
    r.model.batch_invariant = False  # outside the mode, the tuned row limit at any size
    assert use_gemv(r.model, 16, torch.float32) and not use_gemv(r.model, 17, torch.float32)


def test_the_default_decode_is_off_the_gemv_kernels(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a ModelRunner builds it, on a device with no tuned table: a decode takes cuBLAS and
    the per-op kernels."""
    monkeypatch.setattr(gemv_config, "CONFIG_DIR", tmp_path)
    r = ModelRunner(ModelConfig.from_dir(tiny_model_dir), tiny_model_dir, DEVICE, torch.bfloat16,
                    96, 4, 64, "triton", fused_kernels=True)  # fmt: skip
    if not r.model.fused_kernels:  # a CPU host: as the runner sets them up on a GPU
        enable_fused_kernels(r.model, DEVICE)
    assert r.model.gemv_capable and r.model.fused_gemv_max_rows == 0
    assert not use_gemv(r.model, 1, torch.bfloat16)


def test_the_gemv_rows_come_from_the_devices_tuned_table(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where bench/tune_gemv.py measured the GEMV kernels faster up to some row count for this
    layer shape and dtype on this device, forwards of at most that many rows take them; another
    dtype (not measured) keeps them off."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    rows = int(torch.randint(1, 17, (1,)))
    key = gemv_config.layer_key(cfg.hidden_size, cfg.intermediate_size, torch.bfloat16)
    path = gemv_config.table_path(gemv_config.device_name(DEVICE), tmp_path)
    gemv_config.write_table(path, gemv_config.GemvTable({}, {key: rows}), {"device": "test"})
    monkeypatch.setattr(gemv_config, "CONFIG_DIR", tmp_path)
    for dtype, want in ((torch.bfloat16, rows), (torch.float32, 0)):
        r = ModelRunner(cfg, tiny_model_dir, DEVICE, dtype, 96, 4, 64, "triton")
        if not r.model.fused_kernels:
            enable_fused_kernels(r.model, DEVICE)
        assert r.model.fused_gemv_max_rows == want, dtype
        assert use_gemv(r.model, max(want, 1), dtype) == (want > 0)
        assert not use_gemv(r.model, want + 1, dtype)


def test_fused_kernels_only_on_a_gpu_with_plain_weights() -> None:
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_fused_kernels(gpu, "auto", None, None)
    assert use_fused_kernels(gpu, "triton", None, None)
    assert not use_fused_kernels(gpu, "torch", None, None)
    assert not use_fused_kernels(cpu, "auto", None, None)
    assert not use_fused_kernels(cpu, "triton", None, None)
    assert not use_fused_kernels(gpu, "auto", "model.gguf", None)
    assert not use_fused_kernels(gpu, "auto", None, object())


@pytest.mark.skipif(DEVICE.type != "cpu", reason="counts the interpreter's launches")
@pytest.mark.parametrize("gemv_rows", [0, 16])
def test_decode_launches_per_layer(tiny_model_dir: str, gemv_rows: int) -> None:
    """Kernels one decode's layers launch (Triton launches plus the aten ops that are not views,
    each a device kernel on a GPU): 6 a layer on the GEMV kernels, 10 on the per-op ones."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from eagleserve.models import fused_forward

    r = runner(tiny_model_dir, torch.float32, True, gemv_rows)
    bs, pos = 2, 4
    r.req_to_token_pool.req_to_token[:bs, : pos + 1] = torch.arange(1, 1 + bs * (pos + 1)).view(
        bs, -1
    )
    count, inside = [0], [False]
    views = ("view", "_unsafe_view", "reshape", "t", "slice", "select", "empty", "empty_like")

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not inside[0] and func.overloadpacket.__name__ not in views:
                count[0] += 1
            return func(*args, **(kwargs or {}))

    run, layers = InterpretedFunction.run, fused_forward.fused_layers

    def counted_run(self, *args, **kwargs):  # noqa: ANN001, ANN202
        count[0] += 1
        inside[0] = True  # the interpreter's copies of the arguments are not kernels
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False

    def counted_layers(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with Ops():
            return layers(*args, **kwargs)

    InterpretedFunction.run = counted_run  # type: ignore[method-assign]
    fused_forward.fused_layers = counted_layers  # type: ignore[assignment]
    try:
        forward_tokens(r, "decode", torch.tensor([5, 7]), torch.full((bs,), pos),
                       torch.tensor([pos + 1, 2 * pos + 2]), torch.arange(bs),
                       torch.full((bs,), pos), torch.ones(bs, dtype=torch.long))  # fmt: skip
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
        fused_forward.fused_layers = layers  # type: ignore[assignment]
    n_layers = len(r.model.model.layers)
    # Besides the layers: the final norm and the aux states' concatenation (each aux state is
    # the stream sum its layer's first kernel writes: no add of its own).
    per_layer = 6 if gemv_rows else 10
    assert count[0] == per_layer * n_layers + 1 + 1
