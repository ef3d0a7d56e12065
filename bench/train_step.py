"""Where a `train-draft --recipe gpu` training step spends its time, on the device it trains on.

Each row is one setting (--ttt-attention, batch size, head layers) with a fresh head, trained on a
feature
store of the real shape (the target's EAGLE3 feature width, top-k soft labels, windows of up to
--max-len tokens) filled with random values: the step's cost does not depend on the values.
After --warmup steps, --steps steps are timed, then run again under torch.profiler (its own
overhead kept out of the time); the table gives the step's wall time, token-passes per second
(as train-draft reports them), the device's busy time per step (the sum of its kernels;
busy / wall below 1 means the host, its launches or its syncs, leave the device idle), kernel
launches per step, the peak device memory, the warm-up's seconds (a compiled row's compile),
the compiled graphs run per step (one per depth and one per depth's loss when nothing breaks a
graph), and the ops that take the most device time (host time on a CPU).

    python bench/train_step.py --model /tmp/smollm2.gguf --device cuda \
        --out bench/results/train_step_h200.json
CPU smoke test (tiny model directory, tiny sizes):
    python bench/train_step.py --model DIR --device cpu --rows dense:2,sdpa:2 --max-len 32 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine  # noqa: E402
from eagleserve.device import empty_cache, synchronize  # noqa: E402
from eagleserve.spec.head_loader import init_eagle_head  # noqa: E402
from eagleserve.train.features import label_map  # noqa: E402
from eagleserve.train.online import FeatureStore, StoreSource  # noqa: E402
from eagleserve.train.target import load_target, target_layer_ids  # noqa: E402
from eagleserve.train.trainer import TrainConfig, train_head  # noqa: E402


def random_store(
    n_windows: int, max_len: int, width: int, vocab: int, k: int, dev: torch.device, seed: int
) -> FeatureStore:
    """Windows of lengths uniform in [max_len / 8, max_len]; 70 % of rows labelled."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(2, max_len // 8), max_len + 1, (n_windows,), generator=g).tolist()
    n = sum(lens)
    labelled = torch.rand(n, generator=g) < 0.7
    top_p = torch.rand(n, k, generator=g).sort(-1, descending=True).values
    top_p = top_p / top_p.sum(-1, keepdim=True) * labelled[:, None]
    top_ids = torch.randint(0, vocab, (n, k), generator=g).masked_fill(~labelled[:, None], -1)
    store = FeatureStore(
        torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32).to(dev),
        labelled.to(dev),
        torch.randn(n, width, generator=g).to(dev, torch.bfloat16),
        top_ids.to(dev, torch.int32),
        top_p.to(dev, torch.float16),
    )
    starts = [0]
    for m in lens[:-1]:
        starts.append(starts[-1] + m)
    store.windows = list(zip(starts, lens))
    return store


def _device_us(ev: Any) -> float:
    return float(getattr(ev, "self_device_time_total", 0.0) or 0.0)


def profile_row(
    target: Any, dev: torch.device, impl: str, batch_size: int, max_len: int, depths: int,
    k: int, draft_vocab: int, warmup: int, steps: int, top: int, layers: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """One setting: `steps` timed steps, then `steps` more under the profiler (its own host
    overhead kept out of the step time). `impl`: a TTT_ATTENTION form, "+compile" for
    --enable-torch-compile (the warm-up steps pay for the compile); `layers`: the head's
    decoder layers (--draft-num-hidden-layers)."""
    attention, _, option = impl.partition("+")
    vocab = target.config.vocab_size
    aux = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    width = len(aux) * target.config.hidden_size
    draft_ids = torch.arange(min(draft_vocab, vocab))
    head = init_eagle_head("EAGLE3", target, seed=0, draft_token_ids=draft_ids,
                           num_hidden_layers=layers)  # fmt: skip
    store = random_store(batch_size * max(warmup, steps), max_len, width, vocab, k, dev, 0)
    source = StoreSource(store, label_map(draft_ids, vocab), batch_size, depths, 0)
    head.train()

    def run(n_steps: int) -> tuple[float, float]:  # the first n_steps batches, fresh optimizer
        cfg = TrainConfig(out_dir=None, lr=1e-3,
                          batch_size=batch_size, max_len=max_len, epochs=1.0, depths=depths,
                          compute_dtype="bfloat16", save_every=10**9, max_steps=n_steps,
                          soft_labels=True, ttt_attention=attention,
                          enable_torch_compile=option == "compile")  # fmt: skip
        synchronize(dev)
        t0 = time.perf_counter()
        metrics = train_head(head, source, cfg)
        synchronize(dev)
        if "out_of_memory_at_step" in metrics:  # stopped short: the row did not fit
            raise torch.OutOfMemoryError(f"at step {metrics['out_of_memory_at_step']:.0f}")
        return time.perf_counter() - t0, metrics["token_passes"]

    if dev.type != "cpu":
        torch.get_device_module(dev).reset_peak_memory_stats(dev)
    warmup_s, _ = run(warmup)  # a compiled row's compile is in it
    wall, passes = run(steps)
    acts = [torch.profiler.ProfilerActivity.CPU]
    on_device = dev.type != "cpu"
    if on_device:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        run(steps)
    events = prof.key_averages()
    # The kernels alone: an op's entry carries its kernels' device time too (counting both
    # doubled the busy time).
    cpu = torch.autograd.DeviceType.CPU
    kernels = [e for e in events if on_device and _device_us(e) > 0 and e.device_type != cpu]
    busy_us = sum(_device_us(e) for e in kernels)
    launch_ops = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "hipLaunchKernel")
    launches = sum(e.count for e in events if e.key in launch_ops)
    # Compiled graphs run per step (forward ones; each has its backward): a graph break adds one.
    graphs = sum(e.count for e in events if e.key == "CompiledFunction")
    key = _device_us if on_device else (lambda e: float(e.self_cpu_time_total))
    ranked = sorted(events, key=key, reverse=True)[:top]
    peak = torch.get_device_module(dev).max_memory_allocated(dev) if on_device else None
    return {
        "ttt_attention": impl,
        "batch_size": batch_size,
        "draft_num_hidden_layers": layers,
        "step_ms": 1e3 * wall / steps,
        "warmup_s": warmup_s,
        "compiled_graphs_per_step": graphs / steps,
        "token_passes_per_s": passes / wall,  # train_head's own count, as train-draft's
        "device_busy_ms_per_step": busy_us / 1e3 / steps if on_device else None,
        "device_busy_fraction": busy_us / 1e6 / wall if on_device else None,
        "launches_per_step": launches / steps,
        "peak_gb": peak / 2**30 if peak is not None else None,
        "top_ops": [
            {
                "op": e.key[:80],
                "count_per_step": e.count / steps,
                "ms_per_step": key(e) / 1e3 / steps,
            }
            for e in ranked
        ],  # fmt: skip
    }


def profile_rows(
    model: str, device: str, rows: list[tuple[str, int, int]], max_len: int, depths: int, k: int,
    draft_vocab: int, warmup: int, steps: int, top: int, out_path: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every row in turn, each printed and (with `out_path`) the JSON rewritten as it is done:
    a run stopped at its time limit keeps the rows it finished."""
    dev = torch.device(device)
    target, _ = load_target(model, "float32", max_len + 16, dev.type)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else machine(),
        "torch": torch.__version__,
        "shape": {"max_len": max_len, "depths": depths, "top_k": k, "draft_vocab": draft_vocab},
        "rows": [],
    }
    for impl, bs, layers in rows:
        try:
            row = profile_row(target, dev, impl, bs, max_len, depths, k, draft_vocab, warmup,
                              steps, top, layers)  # fmt: skip
        except torch.OutOfMemoryError as e:  # a setting that does not fit is a result too
            row = {"ttt_attention": impl, "batch_size": bs, "draft_num_hidden_layers": layers,
                   "error": f"out of memory: {e}"[:200]}  # fmt: skip
        empty_cache(dev)
        out["rows"].append(row)
        print(row_line(row), flush=True)
        if out_path:
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            with open(out_path, "w") as f:
                json.dump(out, f, indent=1)
    return out


def row_line(r: dict[str, Any]) -> str:
    layers = r.get("draft_num_hidden_layers", 1)
    if "error" in r:
        return f"{r['ttt_attention']:>13} {r['batch_size']:>5} {layers:>6}  {r['error'][:60]}"
    frac, peak = r["device_busy_fraction"], r["peak_gb"]
    busy = "-" if frac is None else f"{100 * frac:.0f}"
    peak_s = "-" if peak is None else f"{peak:.1f}"
    return (f"{r['ttt_attention']:>13} {r['batch_size']:>5} {layers:>6} {r['step_ms']:>8.1f} "
            f"{r['token_passes_per_s']:>15,.0f} {busy:>7} {r['launches_per_step']:>8.0f} "
            f"{peak_s:>8} {r['warmup_s']:>9.1f} {r['compiled_graphs_per_step']:>7.0f}")  # fmt: skip


HEADER = (f"{'attention':>13} {'batch':>5} {'layers':>6} {'step ms':>8} {'token-passes/s':>15} "
          f"{'busy %':>7} {'launches':>8} {'peak GB':>8} {'warm-up s':>9} "
          f"{'graphs':>7}")  # fmt: skip


def parse_row(text: str) -> tuple[str, int, int]:
    """A --rows entry: merge+compile:64 -> ("merge+compile", 64, 1); a third field gives the
    head's layers."""
    impl, bs, *layers = text.split(":")
    return impl, int(bs), int(layers[0]) if layers else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--rows",
        default="merge:64,merge+compile:64,merge+compile:128",
        help="settings, ttt_attention[+compile]:batch_size[:head layers], comma-separated",
    )
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [parse_row(r) for r in a.rows.split(",")]
    print(HEADER, flush=True)
    res = profile_rows(a.model, a.device, rows, a.max_len, a.ttt_steps, a.top_k,
                       a.draft_vocab_size, a.warmup, a.steps, a.top, a.out)  # fmt: skip
    print(res["device"])
    print(HEADER)
    for r in res["rows"]:
        print(row_line(r))
    for r in res["rows"]:
        if "top_ops" in r:
            print(f"\n{r['ttt_attention']} batch {r['batch_size']}: {'op':<70} {'calls':>7} "
                  f"{'ms/step':>8}")  # fmt: skip
            for o in r["top_ops"]:
                print(f"  {o['op']:<88} {o['count_per_step']:>7.1f} {o['ms_per_step']:>8.2f}")


if __name__ == "__main__":
    main()
