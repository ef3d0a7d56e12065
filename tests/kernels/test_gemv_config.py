"""The GEMV kernels' per-device settings (kernels/gemv_config.py) and their tuner
(bench/tune_gemv.py): a tuned setting reaches the launch of its weight shape only, keeps the
output and the batch invariance, a bad table is refused by name, and the tuner writes a table
the kernels then run with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from gemv_inputs import (  # noqa: E402
    SHAPES,
    assert_rows_do_not_depend_on_the_batch,
    close,
    randn,
    rotary,
)

from bench import tune_gemv  # noqa: E402
from eagleserve.kernels import gemv_config as gc  # noqa: E402
from eagleserve.kernels import triton_fused as tf  # noqa: E402
from eagleserve.kernels import triton_gemv as tg  # noqa: E402
from eagleserve.kernels import triton_qkv_rope as tq  # noqa: E402
from eagleserve.kernels.gemv_config import GemvConfig, GemvTable  # noqa: E402


@pytest.fixture
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty config folder in place of the shipped one."""
    monkeypatch.setattr(gc, "CONFIG_DIR", tmp_path)
    return tmp_path


def write(config_dir: Path, configs: dict[str, dict[str, GemvConfig]], rows: dict[str, int]
          ) -> None:  # fmt: skip
    path = gc.table_path(gc.device_name(DEVICE), config_dir)
    gc.write_table(path, GemvTable(configs, rows), {"device": gc.device_name(DEVICE)})


class LaunchSpy:
    """Records the grid of each launch of a Triton kernel and forwards it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def test_a_tuned_setting_reaches_the_launch_of_its_weight_shape_only(
    config_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A down projection [N, K] with a tuned split: its launch takes it (three K ranges summed
    by a second launch) and still equals the unfused result; another shape, and the same shape
    in another dtype, run the defaults."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    n, k = 24 + 8 * int(torch.randint(0, 4, (1,))), 80
    tuned = GemvConfig(block_n=32, block_k=16, split_k=3, num_warps=2, num_stages=2)
    write(config_dir, {"silu_mul_gemm": {gc.shape_key(n, k, torch.float32): tuned}}, {})
    assert gc.config_for("silu_mul_gemm", n, k, torch.float32, DEVICE) == tuned
    default = gc.DEFAULTS["silu_mul_gemm"]
    assert gc.config_for("silu_mul_gemm", n, 2 * k, torch.float32, DEVICE) == default
    assert gc.config_for("silu_mul_gemm", n, k, torch.bfloat16, DEVICE) == default
    assert gc.config_for("norm_gemm", n, k, torch.float32, DEVICE) == gc.DEFAULTS["norm_gemm"]

    spy = LaunchSpy(tg._silu_mul_gemm_kernel)
    monkeypatch.setattr(tg, "_silu_mul_gemm_kernel", spy)
    sums = LaunchSpy(tg._sum_splits_kernel)
    monkeypatch.setattr(tg, "_sum_splits_kernel", sums)
    rows = 5
    gate_up = randn(rows, 2 * k, gen=gen, dtype=torch.float32)
    w = randn(n, k, gen=gen, dtype=torch.float32) / k**0.5
    close(tg.silu_mul_gemm(gate_up, w), F.linear(tf.silu_mul(gate_up), w))
    # K 80 in steps of 16 is 5 steps: 3 splits of 2, 2 and 1 steps; columns in blocks of 32.
    assert spy.grids == [(1, -(-n // 32), 3)] and sums.grids == [(1, -(-n // 32))]
    w2 = randn(n, 2 * k, gen=gen, dtype=torch.float32) / k**0.5
    tg.silu_mul_gemm(randn(rows, 4 * k, gen=gen, dtype=torch.float32), w2)
    assert spy.grids[1] == (1, -(-n // 16), 1) and len(sums.grids) == 1  # the default


def test_tuned_settings_keep_rows_independent_of_the_batch(config_dir: Path) -> None:
    """Settings are keyed by the weight, never the rows: with a tuned setting for each of a
    layer's kernels, a row is bitwise the same alone as inside a batch of 1..40 rows."""
    hidden, nh, nkv, d, inter = SHAPES[0]
    dtype = torch.bfloat16
    write(config_dir, {
        "norm_qkv_rope": {gc.shape_key((nh + 2 * nkv) * d, hidden, dtype): GemvConfig(16, 32)},
        "norm_gemm": {gc.shape_key(2 * inter, hidden, dtype): GemvConfig(64, 128, num_warps=8)},
        "gemm": {gc.shape_key(hidden, nh * d, dtype): GemvConfig(32, 16, num_stages=1)},
        "silu_mul_gemm": {gc.shape_key(hidden, inter, dtype): GemvConfig(16, 32, split_k=2)},
    }, {})  # fmt: skip
    assert gc.config_for("silu_mul_gemm", hidden, inter, dtype, DEVICE).split_k == 2
    assert_rows_do_not_depend_on_the_batch(dtype)


@pytest.mark.parametrize("block_c", [16, 32, 64])
def test_a_large_models_head_size_with_wider_column_blocks(block_c: int) -> None:
    """head_dim 128 (Llama-3-8B's; GQA group 4), whose rotary halves take column blocks up to
    64, as the tuner tries them: the qkv kernel still equals add_rms_norm, the Linear and
    rope_store_kv_, the K/V slots included."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    dtype, rows, hidden, nh, nkv, d = torch.bfloat16, 3, 64, 4, 1, 128
    x, res = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    norm_w = 1 + 0.1 * randn(hidden, gen=gen, dtype=dtype)
    w = randn((nh + 2 * nkv) * d, hidden, gen=gen, dtype=dtype) / hidden**0.5
    cos, sin = rotary(rows, d, gen, dtype)
    k_buf, v_buf = (randn(rows + 4, nkv, d, gen=gen, dtype=dtype) for _ in range(2))
    loc = torch.randperm(rows + 4, generator=gen)[:rows].to(DEVICE)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    normed, _ = tf.add_rms_norm(x, res, norm_w, 1e-5)
    qkv_ref = F.linear(normed, w).view(rows, nh + 2 * nkv, d)
    tf.rope_store_kv_(qkv_ref, nh, cos, sin, k_ref, v_ref, loc)
    with gc.overriding(block_n=block_c, block_k=32):
        qkv, _ = tq.norm_qkv_rope_store_kv(x, res, norm_w, 1e-5, w, None, nh, cos, sin, k_buf,
                                           v_buf, loc)  # fmt: skip
    close(qkv, qkv_ref)
    close(k_buf, k_ref)
    close(v_buf, v_ref)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"block_n": 16, "block_k": 48}, "block_k must be a power of two"),
        ({"block_n": 8}, "block_n must be a power of two >= 16"),
        ({"block_n": 16, "split_k": 0}, "split_k"),
        ({"block_n": 16, "blockk": 64}, "unknown GEMV config fields ['blockk']"),
    ],
)
def test_a_bad_setting_in_a_table_is_refused_by_name(
    config_dir: Path, entry: dict[str, Any], message: str
) -> None:
    path = gc.table_path(gc.device_name(DEVICE), config_dir)
    path.write_text(json.dumps({"configs": {"norm_gemm": {"N=64,K=64,float32": entry}}}))
    gc.clear_cache()
    with pytest.raises(ValueError) as err:
        gc.config_for("norm_gemm", 64, 64, torch.float32, DEVICE)
    assert message in str(err.value) and f"{path}: norm_gemm N=64,K=64,float32" in str(err.value)


def test_a_table_for_an_unknown_kernel_is_refused(config_dir: Path) -> None:
    path = gc.table_path(gc.device_name(DEVICE), config_dir)
    path.write_text(json.dumps({"configs": {"gemm_fp8": {"N=64,K=64,float32": {"block_n": 16}}}}))
    gc.clear_cache()
    with pytest.raises(ValueError, match="unknown GEMV kernels"):
        gc.config_for("norm_gemm", 64, 64, torch.float32, DEVICE)


def test_device_names_make_file_names() -> None:
    assert gc.table_path("NVIDIA H200", Path("/c")) == Path("/c/gemv_NVIDIA_H200.json")
    assert gc.table_path("AMD Instinct MI300X", Path("/c")).name == "gemv_AMD_Instinct_MI300X.json"


def test_the_gemv_layer_is_taken_up_to_the_rows_it_wins_at_every_count() -> None:
    gemv = {1: 10.0, 4: 11.0, 8: 15.0, 16: 20.0}
    assert tune_gemv.gemv_max_rows(gemv, {1: 12.0, 4: 11.0, 8: 14.0, 16: 30.0}) == 4
    assert tune_gemv.gemv_max_rows(gemv, {1: 9.0, 4: 30.0, 8: 30.0, 16: 30.0}) == 0
    assert tune_gemv.gemv_max_rows(gemv, {r: 99.0 for r in gemv}) == 16


def test_the_tuner_accepts_summation_order_and_refuses_a_wrong_output() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    ref = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    step = (ref.float().abs().amax() * 2.0**-8).item()  # one bf16 rounding step at the top
    assert tune_gemv.agrees([(ref.float() + step).to(torch.bfloat16)], [ref])
    wrong = ref.clone()
    wrong[int(torch.randint(0, 4, (1,))), int(torch.randint(0, 64, (1,)))] += 0.5
    assert not tune_gemv.agrees([wrong], [ref])
    assert not tune_gemv.agrees([ref[:2]], [ref])


def test_the_tuner_writes_a_table_the_kernels_then_run(config_dir: Path, tmp_path: Path) -> None:
    """A CPU smoke run (the interpreter; its timings mean nothing): every kernel gets the fastest
    of its candidates that ran and agreed, the layer's GEMV row limit is recorded, and both are
    what the kernels and the model then read for that shape on this device."""
    out = tmp_path / "tune.json"
    res = tune_gemv.main(["--device", str(DEVICE), "--shapes", "tiny", "--rows", "1,3",
                          "--warps", "4", "--procs", "0", "--dtype", "float32",
                          "--config-dir", str(config_dir), "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["shapes"]["tiny"]["gemv_max_rows"] in (0, 1, 3)
    layer = tune_gemv.Layer.of("tiny")
    shape = res["shapes"]["tiny"]
    for kernel in gc.DEFAULTS:
        ran = [c for c in shape["kernels"][kernel]["candidates"] if "us" in c]
        assert len(ran) >= 1 and ran[0]["default"]
        fastest = min(ran, key=lambda c: sum(c["us"].values()))["config"]
        n, k = layer.weight(kernel)
        assert gc.config_for(kernel, n, k, torch.float32, DEVICE) == GemvConfig(**fastest)
    key = gc.layer_key(layer.hidden, layer.intermediate, torch.float32)
    limit = gc.gemv_max_rows(layer.hidden, layer.intermediate, torch.float32, DEVICE)
    assert limit == shape["gemv_max_rows"]
    assert gc.read_table(Path(res["config_file"])).max_rows == {key: shape["gemv_max_rows"]}


def test_the_tuner_splits_k_only_where_column_blocks_leave_the_sms_idle() -> None:
    """Llama-3-8B's layer on a 132-SM GPU: a K split is tried only with a column block that
    gives fewer than two programs per SM (48 GQA heads of qkv, the down projection's 4,096
    columns, gate_up's 28,672 at blocks of 128), never where the blocks alone fill the GPU."""
    layer = tune_gemv.Layer.of("llama3-8b")
    cands = tune_gemv.candidates_of("llama3-8b", (4,), (None,), sms=132)
    heads = layer.heads + 2 * layer.kv_heads

    def programs(kernel: str, block_n: int) -> int:
        if kernel == "norm_qkv_rope":
            return heads * -(-(layer.head_dim // 2) // block_n)
        return -(-layer.weight(kernel)[0] // block_n)

    for kernel, configs in cands.items():
        split = {c.block_n for c in configs if c.split_k > 1}
        assert split == {c.block_n for c in configs if programs(kernel, c.block_n) < 264}
    assert {c.block_n for c in cands["norm_gemm"] if c.split_k > 1} == {128}
    assert {1, 2, 4, 8} <= {c.split_k for c in cands["silu_mul_gemm"]}
