"""Tune the GEMV kernels (kernels/triton_gemv.py) on this device and write their settings.

For each layer shape and each of the four kernels (o_proj's plain `gemm` too), every candidate
setting (column block, K step, K split, warps) is compiled in parallel processes,
its output checked against the default setting's, and timed replayed from a device graph at 1,
4, 8 and 16 rows. The fastest (summed over the row counts) goes into
eagleserve/kernels/configs/gemv_<device>.json (kernels/gemv_config.py reads it at run time),
with `gemv_max_rows`: the largest row count up to which the layer's four tuned GEMV kernels beat
the per-op fused kernels and cuBLAS doing the same work, which the server then uses.

    PYTHONPATH=. python bench/tune_gemv.py [--shapes smollm2-135m] [--procs 12]
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/tune_gemv.py --device cpu --shapes tiny \
        --config-dir /tmp/cfg --out /tmp/tune.json    # CPU smoke run: timings mean nothing

Prints each kernel's default and best time per row count, and writes every candidate's times
to bench/results/tune_gemv.json (`--out`).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import print_table  # noqa: E402
from bench.gemv_layer import Inputs, Layer, launch, launch_fused, outputs  # noqa: E402
from bench.gpu import _save  # noqa: E402
from eagleserve.device import pick_device, synchronize  # noqa: E402
from eagleserve.kernels import gemv_config as gc  # noqa: E402
from eagleserve.kernels.gemv_config import GemvConfig, GemvTable  # noqa: E402

ROWS = (1, 4, 8, 16)


def _pow2_upto(limit: int, choices: tuple[int, ...]) -> list[int]:
    """The choices up to the next power of two of `limit` (a larger block only masks)."""
    top = 1 << max(0, (limit - 1).bit_length())
    return [c for c in choices if c <= max(16, top)]


def candidates(kernel: str, layer: Layer, warps: tuple[int, ...], stages: tuple[int | None, ...],
               sms: int) -> list[GemvConfig]:  # fmt: skip
    """Every setting worth timing. K splits where the column blocks alone give fewer than two
    programs per SM of the device's `sms` (more only add a summing launch); splits that come
    out the same count once."""
    n, k = layer.weight(kernel)
    cols = layer.head_dim // 2 if kernel == "norm_qkv_rope" else n
    col_sets = n // (2 * cols) if kernel == "norm_qkv_rope" else 1  # a program per head and block
    block_ns = _pow2_upto(cols, (16, 32, 64, 128))
    block_ks = _pow2_upto(k, (16, 32, 64, 128, 256, 512, 1024))
    block_ks = [b for b in block_ks if b >= 64] or block_ks  # short K steps: tiny shapes only
    out: list[GemvConfig] = []
    for bn in block_ns:
        split_ok = col_sets * -(-cols // bn) < 2 * sms
        for bk in block_ks:
            steps = -(-k // bk)
            splits = sorted({-(-k // (-(-steps // s) * bk)) for s in (1, 2, 4, 8) if s <= steps})
            for s in splits if split_ok else [1]:
                out += [GemvConfig(bn, bk, s, w, st) for w in warps for st in stages]
    return out


def device_sms(device: torch.device) -> int:
    """The device's multiprocessors (SMs or CUs); 4 for the interpreter's smoke runs."""
    if device.type == "cpu":
        return 4
    return torch.get_device_module(device.type).get_device_properties(device).multi_processor_count


def time_fused(kernel: str, inp: Inputs, rows: int, device: torch.device) -> float:
    return time_us(lambda: launch_fused(kernel, inp, rows), device)


def agrees(out: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    """Within summation-order rounding of the default setting's outputs (fp32: 1e-4 relative;
    16-bit: two rounding steps of the values' magnitude)."""
    for o, r in zip(out, ref, strict=True):
        tol = 1e-4 if r.dtype == torch.float32 else 2.0**-6
        scale = r.float().abs().amax().clamp_min(1e-6)
        if o.shape != r.shape or not bool(((o.float() - r.float()).abs() <= tol * scale).all()):
            return False
    return True


def time_us(fn: Callable[[], Any], device: torch.device, calls: int = 20, reps: int = 5) -> float:
    """Microseconds per call: `calls` calls captured in a device graph, replayed `reps` times
    (the median); on a CPU, plain calls."""
    fn()
    synchronize(device)
    if device.type == "cpu":
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        return 1e6 * (time.perf_counter() - t0) / 2
    mod = torch.get_device_module(device)
    graph = torch.cuda.CUDAGraph()
    stream = mod.Stream(device)
    stream.wait_stream(mod.current_stream(device))
    with mod.stream(stream):  # warm-up off the capture stream, as torch.cuda.graphs advises
        fn()
    mod.current_stream(device).wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)


_worker_inputs: dict[tuple[str, str, str], Inputs] = {}  # a compile process's, built once


def _compile(job: tuple[str, str, str, str, dict[str, Any]]) -> str | None:
    """(worker) Compile one candidate into Triton's cache by running it once; its error, if any."""
    kernel, shape, dtype, device, config = job
    dev = torch.device(device)
    key = (shape, dtype, device)
    if key not in _worker_inputs:
        _worker_inputs[key] = Inputs(Layer.of(shape), getattr(torch, dtype), dev, 1)
    try:
        with gc.overriding(**config):
            launch(kernel, _worker_inputs[key], 1)
        synchronize(dev)
    except Exception as e:  # out of registers or shared memory: a setting this device cannot run
        return repr(e)[:300]
    return None


def tune_kernel(kernel: str, inp: Inputs, cands: list[GemvConfig],
                errors: dict[GemvConfig, str], rows: tuple[int, ...], device: torch.device
                ) -> list[dict[str, Any]]:  # fmt: skip
    """Every candidate's times per row count (or why it was left out), the default first."""
    default = gc.DEFAULTS[kernel]
    ref = {r: [t.clone() for t in outputs(kernel, inp, r)] for r in rows}
    results = []
    todo = [default, *(c for c in cands if c != default)]
    for c in tqdm(todo, desc=f"{kernel} settings", mininterval=5, leave=False):
        row: dict[str, Any] = {"config": asdict(c), "default": c == default}
        if c in errors:
            results.append({**row, "error": errors[c]})
            continue
        try:
            with gc.overriding(**asdict(c)):
                if not all(agrees(outputs(kernel, inp, r), ref[r]) for r in rows):
                    results.append({**row, "error": "output differs from the default setting's"})
                    continue
                row["us"] = {r: time_us(lambda r=r: launch(kernel, inp, r), device) for r in rows}
        except Exception as e:
            results.append({**row, "error": repr(e)[:300]})
            continue
        results.append(row)
    return results


def best(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The candidate with the least time summed over the row counts."""
    ran = [r for r in results if "us" in r]
    if not ran:
        raise RuntimeError(f"no setting ran: {results[0].get('error')}")
    return min(ran, key=lambda r: sum(r["us"].values()))


def gemv_max_rows(gemv_us: dict[int, float], fused_us: dict[int, float]) -> int:
    """The largest row count up to which the GEMV layer is at least as fast at every count."""
    rows = 0
    for r in sorted(gemv_us):
        if gemv_us[r] > fused_us[r]:
            break
        rows = r
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="", help="num_stages to try besides Triton's default")
    ap.add_argument(
        "--procs",
        type=int,
        default=None,
        help="processes compiling candidates ahead of the timing (0: none; default: up to 12 "
        "on a GPU, none on a CPU)",
    )
    ap.add_argument("--config-dir", default=str(gc.CONFIG_DIR))
    ap.add_argument("--out", default="bench/results/tune_gemv.json")
    args = ap.parse_args(argv)
    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    rows = tuple(int(r) for r in args.rows.split(","))
    warps = tuple(int(w) for w in args.warps.split(","))
    stages = (None, *(int(s) for s in args.stages.split(",") if s))
    name = gc.device_name(device)
    path = gc.table_path(name, Path(args.config_dir))
    old = gc.read_table(path)
    table = GemvTable({k: dict(v) for k, v in old.configs.items()}, dict(old.max_rows))
    res: dict[str, Any] = {"device": name, "torch": torch.__version__, "dtype": args.dtype,
                           "rows": list(rows), "config_file": str(path), "shapes": {}}  # fmt: skip
    meta = {"device": name, "torch": torch.__version__, "triton": _triton_version(),
            "written_by": "bench/tune_gemv.py --shapes " + args.shapes}  # fmt: skip
    t_start = time.perf_counter()

    def save() -> None:  # after every kernel: a run stopped early keeps what it measured
        gc.write_table(path, table, meta)
        res["seconds"] = time.perf_counter() - t_start
        _save(res, args.out)

    procs = args.procs if args.procs is not None else (0 if device.type == "cpu" else 12)
    sms = device_sms(device)
    for shape in args.shapes.split(","):
        res["shapes"][shape] = {}
        tune_shape(shape, dtype, device, rows, candidates_of(shape, warps, stages, sms), procs,
                   table, res["shapes"][shape], save)  # fmt: skip
    print(f"wrote {path} and {args.out} ({res['seconds']:.0f} s)")
    return res


def candidates_of(shape: str, warps: tuple[int, ...], stages: tuple[int | None, ...], sms: int
                  ) -> dict[str, list[GemvConfig]]:  # fmt: skip
    layer = Layer.of(shape)
    return {k: candidates(k, layer, warps, stages, sms) for k in gc.DEFAULTS}


def compile_all(
    shape: str, dtype: torch.dtype, device: torch.device, cands: dict[str, list[GemvConfig]],
    procs: int,
) -> dict[GemvConfig, str]:  # fmt: skip
    """Every candidate compiled into Triton's cache by `procs` processes; the ones that failed."""
    jobs = [(k, c) for k in gc.DEFAULTS for c in cands[k]]
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(min(procs, os.cpu_count() or 1), mp_context=ctx) as pool:
        done = pool.map(_compile, [(k, shape, gc.dtype_name(dtype), str(device), asdict(c))
                                   for k, c in jobs])  # fmt: skip
        errors = {c: e for (_, c), e in zip(jobs, done, strict=True) if e is not None}
    print(f"{shape}: {len(jobs)} candidates compiled in {time.perf_counter() - t0:.0f} s "
          f"({len(errors)} failed)", flush=True)  # fmt: skip
    return errors


def tune_shape(shape: str, dtype: torch.dtype, device: torch.device, rows: tuple[int, ...],
               cands: dict[str, list[GemvConfig]], procs: int, table: GemvTable,
               shape_res: dict[str, Any], save: Callable[[], None]) -> None:  # fmt: skip
    """Each kernel of one layer shape tuned into `table` (saved after each), then the layer's
    GEMV row limit; every candidate's times into `shape_res`."""
    layer = Layer.of(shape)
    inp = Inputs(layer, dtype, device, max(rows))
    errors = compile_all(shape, dtype, device, cands, procs) if procs else {}
    shape_res.update(layer=asdict(layer), kernels={})
    gemv_total = dict.fromkeys(rows, 0.0)
    fused_total = dict.fromkeys(rows, 0.0)
    lines = []
    for kernel in gc.DEFAULTS:
        results = tune_kernel(kernel, inp, cands[kernel], errors, rows, device)
        win = best(results)
        fused = {r: time_fused(kernel, inp, r, device) for r in rows}
        n, k = layer.weight(kernel)
        table.configs.setdefault(kernel, {})[gc.shape_key(n, k, dtype)] = GemvConfig(
            **win["config"]
        )
        default = results[0].get("us", {})
        for r in rows:
            gemv_total[r] += win["us"][r]
            fused_total[r] += fused[r]
            lines.append((kernel, r, default.get(r, float("nan")), win["us"][r], fused[r]))
        shape_res["kernels"][kernel] = {"best": win["config"], "fused_us": fused,
                                        "candidates": results}  # fmt: skip
        save()
    layer_rows = gemv_max_rows(gemv_total, fused_total)
    table.max_rows[gc.layer_key(layer.hidden, layer.intermediate, dtype)] = layer_rows
    shape_res.update(gemv_us=gemv_total, fused_us=fused_total, gemv_max_rows=layer_rows)
    save()
    print_table(("kernel", "rows", "default us", "tuned us", "fused+cuBLAS us"), lines,
                title=f"{shape} on {gc.device_name(device)} ({gc.dtype_name(dtype)})")  # fmt: skip
    for kernel in gc.DEFAULTS:
        print(f"  {kernel}: {shape_res['kernels'][kernel]['best']}")
    print("  layer (4 kernels) tuned GEMV vs fused, us by rows: "
          + ", ".join(f"{r}: {gemv_total[r]:.1f} vs {fused_total[r]:.1f}" for r in rows)
          + f" -> gemv_max_rows {layer_rows}", flush=True)  # fmt: skip


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    main()
