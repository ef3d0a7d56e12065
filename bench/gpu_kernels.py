"""Decoder-layer kernels side by side (run on a lent GPU; random weights, no download): the
unfused torch layers, the per-op fused Triton kernels (`fused`: kernels/triton_fused.py) and,
for batches of at most 16 rows, the GEMV kernels that fold norm/rotary/KV write/SiLU into the
GEMMs (`gemv`: kernels/triton_gemv.py, with the device's tuned settings from
kernels/gemv_config.py where bench/tune_gemv.py wrote them; above 16 rows it is the `fused`
path; `gemv:k256:w8:s4` overrides the K step, warps and down-projection split). Kernel launches
per target decode and per layer (torch profiler, eager) and decode ms (device graphs replayed,
as the server runs it, and eager), for the default model's shape (SmolLM2-135M) and the
Llama-3-8B shape, batch 1, 16 and 32, each over a 128-token context.

    PYTHONPATH=. python bench/gpu_kernels.py [--out bench/results/gpu_kernels.json]
    PYTHONPATH=. python bench/gpu_kernels.py --shapes smollm2-135m   # the default model only
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/gpu_kernels.py --device cpu --shapes tiny \
        --iters 1 --out /tmp/gk.json   # CPU smoke run: launch counts

Also reports the largest |logit| difference from the unfused decode (same weights, same cache),
and the bandwidth floor of each shape (weight bytes / copy bandwidth). On a CPU (a smoke run
under TRITON_INTERPRET=1) launches are counted instead: Triton kernel launches plus the aten
ops that are not views (each a device kernel on a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu import _save, device_bandwidth, llama3_8b_config  # noqa: E402
from eagleserve.config import ModelConfig  # noqa: E402
from eagleserve.device import pick_device, synchronize  # noqa: E402
from eagleserve.kernels import gemv_config  # noqa: E402
from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context  # noqa: E402
from eagleserve.model_executor.model_runner import ModelRunner  # noqa: E402

CONTEXT = 128
BATCHES = (1, 16, 32)
MODES = ("unfused", "fused", "gemv")
_GEMV_FIELDS = {"n": "block_n", "k": "block_k", "w": "num_warps", "s": "split_k", "p": "num_stages"}


def smollm2_135m_config(layers: int) -> dict[str, Any]:
    """SmolLM2-135M-Instruct's shape (the default model)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": layers,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def tiny_config(layers: int) -> dict[str, Any]:
    """The default model's layout shrunk (CPU smoke runs: launch counts under the interpreter)."""
    return {**smollm2_135m_config(layers), "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16}  # fmt: skip


def gemv_settings(mode: str) -> contextlib.AbstractContextManager[None]:
    """The GEMV kernels' settings a mode fixes for every kernel ("gemv:k128:w8:s4": K step,
    warps, K split; n: column block, p: stages); none: the tuned table."""
    opts = {_GEMV_FIELDS[o[0]]: int(o[1:]) for o in mode.split(":")[1:]}
    return gemv_config.overriding(**opts)


def settings_in_force(shape: str, device: torch.device) -> dict[str, dict[str, Any]]:
    """The GEMV kernels' settings for `shape`'s bf16 weights (tuned table or defaults, with a
    mode's overrides), as the launches of a mode read them."""
    from dataclasses import asdict

    from bench.tune_gemv import Layer  # (it imports this module)

    layer = Layer.of(shape)
    return {k: asdict(gemv_config.config_for(k, *layer.weight(k), torch.bfloat16, device))
            for k in gemv_config.DEFAULTS}  # fmt: skip


def make_runner(path: str, device: torch.device, mode: str, graphs: bool) -> ModelRunner:
    fused = mode != "unfused"
    runner = ModelRunner(
        ModelConfig.from_dir(path), path, device, torch.bfloat16,
        max_total_tokens=max(BATCHES) * (CONTEXT + 2) + 8, max_running_requests=max(BATCHES),
        max_context_len=1024, attention_backend="triton", load_format="dummy",
        fused_kernels=fused,
    )  # fmt: skip
    if fused and not runner.model.fused_kernels:  # a CPU smoke run (Triton interpreter)
        from eagleserve.models.fused_forward import enable_fused_kernels

        enable_fused_kernels(runner.model, device)
    if mode == "fused":  # the per-op fused kernels at every batch size
        runner.model.fused_gemv_max_rows = 0
    elif mode.startswith("gemv"):  # the GEMV kernels up to 16 rows, whatever the model's size
        runner.model.fused_gemv_max_rows = 16
    if graphs:
        runner.capture_graphs(max(BATCHES), (), tree=False)
    return runner


def decode_batch(runner: ModelRunner, bs: int) -> ForwardBatch:
    """bs requests with CONTEXT cached positions each, decoding position CONTEXT (slots fixed)."""
    device = runner.device
    r2t = runner.req_to_token_pool.req_to_token
    rows = torch.arange(bs, device=device)
    slots = torch.arange(1, 1 + bs * (CONTEXT + 1), device=device).view(bs, CONTEXT + 1)
    r2t[:bs, : CONTEXT + 1] = slots
    ctx = torch.full((bs,), CONTEXT, dtype=torch.long, device=device)
    return ForwardBatch(
        mode="decode",
        input_ids=(torch.arange(bs, device=device) * 37 + 1000) % runner.config.vocab_size,
        positions=ctx.clone(),
        out_cache_loc=slots[:, CONTEXT].contiguous(),
        req_pool_indices=rows,
        prefix_lens=ctx,
        extend_lens=torch.ones(bs, dtype=torch.long, device=device),
        host=HostLens.per_request(1, CONTEXT, bs),
        kv_pool=runner.token_to_kv_pool,
        attn_backend=runner.attn_backend,
    )


def eager(runner: ModelRunner, bs: int) -> torch.Tensor:
    fb = decode_batch(runner, bs)
    runner.attn_backend.init_forward_metadata(fb)
    with torch.inference_mode(), forward_context(fb):
        return runner.model().logits


def time_ms(fn: Any, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return 1000 * (time.perf_counter() - t0) / iters


def kernel_launches(runner: ModelRunner, bs: int) -> tuple[int, list[dict[str, Any]]]:
    """Device kernels of one eager decode forward (copies and fills not counted), and the
    kernels that take the most device time (name, launches, total µs)."""
    from torch.profiler import ProfilerActivity, profile

    eager(runner, bs)
    synchronize(runner.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager(runner, bs)
        synchronize(runner.device)
    kernels = [e for e in prof.events() if e.device_type.name in ("CUDA", "HIP")]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:80], []).append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    launches = sum(1 for e in kernels if not e.name.startswith(("Memcpy", "Memset")))
    return launches, [{"kernel": n, "launches": len(t), "us": round(sum(t), 1)} for n, t in top]


_VIEW_OPS = ("view", "_unsafe_view", "reshape", "t", "transpose", "slice", "select", "expand",
             "unsqueeze", "squeeze", "split", "chunk", "as_strided", "alias", "detach", "empty",
             "empty_like", "empty_strided", "lift_fresh", "_to_copy_noop")  # fmt: skip


def counted_launches(runner: ModelRunner, bs: int) -> int:
    """CPU (interpreter) stand-in for the profiler: Triton launches of one eager decode forward
    plus its aten ops that are not views or allocations."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    count, inside = [0], [False]  # the interpreter's own copies of a launch's args not counted

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not inside[0] and func.overloadpacket.__name__ not in _VIEW_OPS:
                count[0] += 1
            return func(*args, **(kwargs or {}))

    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):  # noqa: ANN001, ANN202
        count[0] += 1
        inside[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False

    InterpretedFunction.run = counted_run  # type: ignore[method-assign]
    try:
        with Ops():
            eager(runner, bs)
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
    return count[0]


def batch_row(runner: ModelRunner, bs: int, iters: int) -> dict[str, Any]:
    device = runner.device
    row: dict[str, Any] = {"eager_ms": time_ms(lambda: eager(runner, bs), device, iters)}
    if device.type != "cpu":
        fb = decode_batch(runner, bs)
        row["graph_ms"] = time_ms(lambda: runner.forward(fb), device, iters)
        row["launches"], row["top_kernels"] = kernel_launches(runner, bs)
    elif runner.model.fused_kernels:  # the unfused CPU path is not the GPU's kernels
        row["launches"] = counted_launches(runner, bs)
    if "launches" in row:
        row["launches_per_layer"] = row["launches"] / runner.config.num_hidden_layers
    return row


def measure(path: str, device: torch.device, mode: str, iters: int) -> dict[str, Any]:
    runner = make_runner(path, device, mode, graphs=device.type != "cpu")
    out: dict[str, Any] = {"mode": mode, "logits": {}}
    for bs in BATCHES:
        out[bs] = batch_row(runner, bs, iters)
        out["logits"][bs] = eager(runner, bs).float().cpu()
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/gpu_kernels.json")
    ap.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (smoke runs)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help="of " + ", ".join(MODES) + "; "
        "gemv: the GEMV kernels with the device's tuned settings (bench/tune_gemv.py) or the "
        "defaults; gemv:kN sets every kernel's K step to N, :wN warps, :sN the down "
        "projection's K split, :nN the column block, :pN stages (gemv,gemv:k128:s4)",
    )
    args = ap.parse_args()
    device = pick_device(args.device)
    gpu = device.type != "cpu"
    name = torch.get_device_module(device).get_device_name(device) if gpu else "cpu"
    res: dict[str, Any] = {"device": name, "torch": torch.__version__, "context": CONTEXT}
    bw = device_bandwidth(device) if gpu else 0.0
    res["bandwidth_gb_s"] = bw / 1e9
    configs = {"smollm2-135m": (smollm2_135m_config, 30), "llama3-8b": (llama3_8b_config, 32),
               "tiny": (tiny_config, 2)}  # fmt: skip
    rows: list[dict[str, Any]] = []
    print(f"device: {name}; bandwidth {res['bandwidth_gb_s']:.0f} GB/s; context {CONTEXT}")
    head = ("shape", "batch", "mode", "launches", "/layer", "graph ms", "eager ms", "floor ms")
    print("{:<14}{:>6}{:>15}{:>10}{:>8}{:>10}{:>10}{:>10}  max|dlogit|".format(*head), flush=True)
    for shape in args.shapes.split(","):
        make, layers = configs[shape]
        tmp = tempfile.mkdtemp()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(make(args.layers or layers), f)
        ref = None  # the first mode measured (unfused by default) is the logits' reference
        for mode in args.modes.split(","):
            try:
                with gemv_settings(mode):
                    run = measure(tmp, device, mode, args.iters)
                    if mode.startswith("gemv") and shape != "tiny":
                        res.setdefault("gemv_settings", {}).setdefault(shape, {})[mode] = (
                            settings_in_force(shape, device)
                        )
            except Exception as e:  # a setting that fails to compile or run costs its rows only
                rows.append({"shape": shape, "mode": mode, "error": repr(e)[:500]})
                print(f"{shape:<14}{'':>6}{mode:>15}  failed: {repr(e)[:200]}", flush=True)
                continue
            finally:
                gc.collect()  # a runner's weights and graphs go before the next is built
                if gpu:
                    torch.get_device_module(device).empty_cache()
            ref = ref or run
            for bs in BATCHES:
                floor_ms = 1000 * ref["weight_bytes"] / bw if bw else None
                diff = (run["logits"][bs] - ref["logits"][bs]).abs().max().item()
                r = {"shape": shape, "batch": bs, "mode": mode, **run[bs], "floor_ms": floor_ms,
                     "max_logit_diff": diff}  # fmt: skip
                rows.append(r)
                print(
                    f"{shape:<14}{bs:>6}{mode:>15}"
                    f"{r.get('launches', 0):>10}{r.get('launches_per_layer', 0):>8.1f}"
                    f"{r.get('graph_ms', 0):>10.3f}{r['eager_ms']:>10.3f}{floor_ms or 0:>10.3f}"
                    f"  {diff:.3g}",
                    flush=True,
                )
            res["rows"] = rows
            _save(res, args.out)  # each mode as it is measured: a run stopped early keeps them
    for r in rows:
        if r.get("batch") == 1 and r.get("top_kernels"):
            top = r["top_kernels"][:6]
            print(f"{r['shape']} batch 1 {r['mode']}: " + ", ".join(
                f"{k['kernel'][:40]} x{k['launches']} {k['us']:.0f} us" for k in top))  # fmt: skip
    _save(res, args.out)


if __name__ == "__main__":
    main()
