"""The one GPU check: tests, the default-model table, the 8B-shaped bench, the other GPU benches,
the host-overhead bench, and a repro of a reported hang, each stage on its own, results in JSON.

    python bench/gpu_check.py --model /tmp/smollm2.gguf --out DIR
    python bench/gpu_check.py --model PATH.gguf --out DIR --device cpu --quick   # smoke test

Needs nothing but the checkout and the default model file (no network). Stages, in order, each
in its own child process with a time limit (one failure or hang does not stop the rest), each
writing DIR/<stage>.json (and .log); DIR/summary.json is rewritten after every stage:
  tests     pytest -q: the batch-invariant switch, GEMV and deterministic-inference tests,
            tests/spec/test_gpu_paths.py, the other tests/kernels files (not the CPU kernels'),
            the fused-forward tests
  table     the default model: target-only, EAGLE3 chain 3, chain 5, tree (3 steps, top-4, 8
            tokens), the shipped config (configs/smollm2-135m-eagle.yaml, adaptive); batch 1
            (8 held-out prompts one after another), 16 and 64, each batch size warmed by an
            untimed pass of up to 80 tokens first; greedy, EOS ignored; tok/s, x
            target-only, tau, acceptance by depth, answers equal to target-only's; with
            --draft HEAD, the shipped config and chain 3 with that head too
  gpu       bench/gpu.py --skip-hf --deterministic (Llama-3-8B-shaped, random weights; the
            batch-invariant mode's decode cost too)
  kernels   bench/gpu_kernels.py, if there: run(out_dir) or main()
  determinism  bench/deterministic_gpu.py, if there: run(out_dir) or main()
  requests  bench/request_times.py: each request's time for target-only (graphed and eager
            prefill, and with --enable-pdl), the shipped config and chain 3 (with and without
            --enable-pdl), alone and 16 at once, two passes
  host      bench/host_overhead.py on the default model: target-only, adaptive held at k = 0,
            adaptive, chain 3, tree (stages, ops and host reads per iteration, GPU idle share)
  train     bench/train_step.py on the default model (a training step's time, device busy
            share and top ops; dense vs sdpa depth attention, batch 16-64)
  hang      target-only Engine, then an EAGLE3 chain-3 Engine with dtype passed explicitly, in
            one process (reported to print nothing for 60-150 s)
  load      bench/load.py on the shipped config with deterministic inference: 16 clients of the
            whole request mix for 30 s against a server on the GPU, every greedy and seeded
            answer recomputed by an offline Engine on the GPU and equal
Inside a stage, faulthandler dumps every thread's traceback into DIR/<stage>.traceback when a
step runs longer than --hang-s, so a hang leaves where it hung.
"""

from __future__ import annotations

import argparse
import faulthandler
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench.gpu_table import chain, stage_table  # noqa: E402

STAGES = ("tests", "table", "gpu", "kernels", "determinism", "requests", "host", "train", "hang",
          "load")  # fmt: skip
# Seconds each stage may run on the GPU (the whole check is also held to --budget-s).
LIMITS = {"tests": 100, "table": 240, "gpu": 120, "kernels": 45, "determinism": 45,
          "requests": 90, "host": 150, "train": 90, "hang": 60, "load": 150}  # fmt: skip
HOOKS = {"kernels": "gpu_kernels.py", "determinism": "deterministic_gpu.py"}


class Stage:
    """Where one stage writes: DIR/<name>.json (rewritten by save) and its traceback file."""

    def __init__(self, out: str, name: str, hang_s: float) -> None:
        self.path = os.path.join(out, f"{name}.json")
        self.tb = open(os.path.join(out, f"{name}.traceback"), "a")  # noqa: SIM115
        self.hang_s = hang_s
        self.data: dict[str, Any] = {"stage": name}

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=2)

    @contextmanager
    def watch(self, what: str) -> Any:
        """Dumps every thread's stack into the traceback file if `what` outlasts hang_s."""
        print(f"[{time.strftime('%H:%M:%S')}] {what}", file=self.tb, flush=True)
        faulthandler.dump_traceback_later(self.hang_s, repeat=False, file=self.tb)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def stage_hook(args: argparse.Namespace, st: Stage, file: str) -> None:
    """Another GPU bench by path, its JSON written into --out: the determinism bench's
    run(model, out_json, ...) with this check's model and token count, the kernels bench's
    main() with --out."""
    path = os.path.join(HERE, file)
    spec = importlib.util.spec_from_file_location(file[:-3], path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    with st.watch(f"import {file}"):
        spec.loader.exec_module(mod)
    out_json = os.path.join(args.out, file.replace(".py", "_result.json"))
    with st.watch(file):
        if hasattr(mod, "run"):
            device = "cpu" if args.device == "cpu" else "cuda"
            result = mod.run(args.model, out_json, max_new=args.new_tokens, device=device,
                             prompts=4 if args.quick else 24,
                             batch1_prompts=2 if args.quick else 24)  # fmt: skip
        else:
            sys.argv = [path, "--out", out_json, "--device", args.device]
            result = mod.main()
    if isinstance(result, dict):
        st.data["result"] = result


def stage_host(args: argparse.Namespace, st: Stage) -> None:
    from bench import host_overhead

    batches = (1, 4) if args.quick else (1, 32)
    with st.watch("host_overhead"):
        st.data["result"] = host_overhead.run(
            args.model, args.device, batches, 8 if args.quick else 32,
            out=os.path.join(args.out, "host_overhead.json"),
        )  # fmt: skip


def stage_hang(args: argparse.Namespace, st: Stage) -> None:
    """The reported hang: an EAGLE3 chain-3 Engine with dtype passed explicitly, created after
    a target-only Engine in the same process."""
    from eagleserve import Engine, SamplingParams
    from eagleserve.device import pick_device

    dev = pick_device(args.device)
    dtype = "float32" if dev.type == "cpu" else "bfloat16"
    p = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    times = {}
    for name, kw in (("target-only", {}), ("chain 3", chain(3))):
        t0 = time.perf_counter()
        with st.watch(f"{name} dtype={dtype}: build"):
            eng = Engine(
                model=args.model, device=str(dev), dtype=dtype, max_total_tokens=4096, **kw
            )
        with st.watch(f"{name} dtype={dtype}: generate"):
            eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p)
        times[name] = time.perf_counter() - t0
        st.data["seconds"] = times
        st.save()
        eng.close()
        del eng


def stage_tests(args: argparse.Namespace, st: Stage, limit: float) -> None:
    # Most telling first (each test compiles its Triton kernels: the stage may hit its limit,
    # as it did at ae931d0 after 14 tests of test_gpu_paths.py): the kernels that have run only
    # under the interpreter, the GPU paths (real graphs, the verify graph's acceptance), the
    # training attention on the GPU's SDPA kernels, the batch-invariant mode's row tests, then
    # every other GPU kernel test.
    first = ["tests/kernels/test_triton_sample.py", "tests/kernels/test_triton_accept.py",
             "tests/kernels/test_triton_top1.py", "tests/kernels/test_triton_tree.py",
             "tests/spec/test_gpu_paths.py", "tests/train/test_ttt.py",
             "tests/models/test_batch_invariant_switch.py", "tests/kernels/test_triton_gemv.py",
             "tests/kernels/test_batch_invariant.py",
             "tests/spec/test_deterministic_inference.py"]  # fmt: skip
    rest = sorted(
        os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests/kernels/test_*.py"))
        if not os.path.basename(f).startswith("test_cpu_")
    )  # fmt: skip
    files = first + [f for f in rest if f not in first] + ["tests/models/test_fused_forward.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", *files,
           f"--junitxml={os.path.join(args.out, 'tests.xml')}"]  # fmt: skip
    if args.quick:
        cmd += ["-k", "not graphs"]
    st.data["command"] = " ".join(cmd)
    run_child(st, cmd, limit)


def stage_gpu(args: argparse.Namespace, st: Stage, limit: float) -> None:
    if args.device == "cpu":
        st.data["skipped"] = "bench/gpu.py needs a GPU"
        return
    cmd = [sys.executable, os.path.join(HERE, "gpu.py"), "--skip-hf", "--deterministic",
           "--out", os.path.join(args.out, "gpu_result.json")]  # fmt: skip
    run_child(st, cmd, limit, child_env())


def stage_train(args: argparse.Namespace, st: Stage, limit: float) -> None:
    device = "cpu" if args.device == "cpu" else "cuda"
    cmd = [sys.executable, os.path.join(HERE, "train_step.py"), "--model", args.model,
           "--device", device, "--out", os.path.join(args.out, "train_step.json")]  # fmt: skip
    if args.quick:
        rows = "dense:2,sdpa:2,merge:2"
        cmd += ["--rows", rows, "--max-len", "64", "--steps", "2", "--warmup", "1"]
    else:  # the default rows, the compiled ones last (their warm-up compiles); short timings
        cmd += ["--steps", "3", "--warmup", "2"]
    run_child(st, cmd, limit, {**child_env(), "TQDM_DISABLE": "1"})  # the table, not the bars


def stage_requests(args: argparse.Namespace, st: Stage, limit: float) -> None:
    cmd = [sys.executable, os.path.join(HERE, "request_times.py"), "--model", args.model,
           "--device", args.device, "--new-tokens", str(args.new_tokens),
           "--out", os.path.join(args.out, "request_times.json")]  # fmt: skip
    if args.quick:
        cmd += ["--configs", "target-only,adaptive", "--batch", "2"]
    else:
        # Adaptive held at k = 0 against target-only: where the k = 0 path loses (its steps
        # split by kind: plain, flush, probe with catch-up; the first token).
        cmd += ["--configs", "target-only,adaptive (k = 0),adaptive,target-only (eager prefill),"
                "chain 3",
                "--batch", "16"]  # fmt: skip
    run_child(st, cmd, limit, {**child_env(), "TQDM_DISABLE": "1"})


def stage_load(args: argparse.Namespace, st: Stage, limit: float) -> None:
    device = "cpu" if args.device == "cpu" else "cuda"
    out = os.path.join(args.out, "load_result.json")  # the stage's own JSON is load.json
    cmd = [sys.executable, os.path.join(HERE, "load.py"), "--config", "smollm2-135m-eagle",
           "--model", args.model, "--device", device, "--out", out]  # fmt: skip
    if args.quick:
        cmd += "--clients 4 --duration 5 --max-total-tokens 1024 --max-tokens 8".split()
        cmd += "--long-max-tokens 16 --long-repeats 1,2".split()
    else:
        cmd += "--clients 16 --duration 30 --max-total-tokens 8192".split()
        cmd.append("--serve-flags=--enable-deterministic-inference")  # a value, not a flag
    run_child(st, cmd, limit, {**child_env(), "TQDM_DISABLE": "1"})


def run_child(st: Stage, cmd: list[str], limit: float, env: dict[str, str] | None = None) -> None:
    """cmd in the checkout, stopped 5 s before the stage's limit; its return code (or
    "timeout") and the tail of its output go into the stage's JSON and to stdout, and the
    stage is ok only when the child returned 0. env None: this process's environment."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit - 5,
                           env=env)  # fmt: skip
        st.data["rc"], tail = p.returncode, (p.stdout + p.stderr)[-6000:]
    except subprocess.TimeoutExpired as exc:
        st.data["rc"], tail = "timeout", str(exc.stdout or "")[-6000:]
    st.data["tail"] = tail
    st.data["ok"] = st.data["rc"] == 0
    print(tail)


def child_env() -> dict[str, str]:
    """The environment for a child: this checkout first on the path, the caller's entries kept
    (on a GPU host the carried wheels, such as gguf, live there)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}


def run_stage(args: argparse.Namespace) -> None:
    """In the child process: one stage, its JSON saved whatever happens."""
    st = Stage(args.out, args.stage, args.hang_s)
    t0 = time.perf_counter()
    try:
        if args.stage == "table":
            stage_table(args, st)
        elif args.stage == "host":
            stage_host(args, st)
        elif args.stage == "hang":
            stage_hang(args, st)
        elif args.stage in HOOKS:
            stage_hook(args, st, HOOKS[args.stage])
        elif args.stage == "tests":
            stage_tests(args, st, args.limit_s)
        elif args.stage == "gpu":
            stage_gpu(args, st, args.limit_s)
        elif args.stage == "train":
            stage_train(args, st, args.limit_s)
        elif args.stage == "requests":
            stage_requests(args, st, args.limit_s)
        elif args.stage == "load":
            stage_load(args, st, args.limit_s)
        st.data.setdefault("ok", "errors" not in st.data)
    except BaseException:
        st.data["ok"], st.data["error"] = False, traceback.format_exc()
        print(st.data["error"], flush=True)
    st.data["seconds"] = st.data.get("seconds", time.perf_counter() - t0)
    st.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="the default model's .gguf (or a folder)")
    ap.add_argument("--out", required=True, help="folder for the JSON, logs and tracebacks")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke test)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (quick: 6)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole check's limit")
    ap.add_argument("--hang-s", type=float, default=120.0, help="a step's time before a dump")
    ap.add_argument("--limits", default="", help="per-stage seconds, e.g. table=120,tests=60")
    ap.add_argument("--draft", default="", help="table: also the shipped config and chain 3 "
                    "with this head (a folder, e.g. a train-draft OUT)")  # fmt: skip
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--limit-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.new_tokens is None:
        args.new_tokens = 6 if args.quick else 128
    os.makedirs(args.out, exist_ok=True)
    if args.stage:
        run_stage(args)
        return
    for item in filter(None, args.limits.split(",")):
        name, secs = item.split("=")
        LIMITS[name] = float(secs)
    start = time.perf_counter()
    summary: dict[str, Any] = {"argv": sys.argv, "stages": {}}
    for name in args.stages.split(","):
        left = args.budget_s - (time.perf_counter() - start)
        limit = min(LIMITS[name] * (3 if args.device == "cpu" else 1), left)
        if limit < 20:
            summary["stages"][name] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--stage", name,
               "--model", args.model, "--out", args.out, "--device", args.device,
               "--new-tokens", str(args.new_tokens), "--hang-s", str(min(args.hang_s, limit - 10)),
               "--limit-s", str(limit), "--draft", args.draft] + (["--quick"] if args.quick
                                                                   else [])  # fmt: skip
        t0 = time.perf_counter()
        print(f"== {name} (limit {limit:.0f} s)", flush=True)
        with open(os.path.join(args.out, f"{name}.log"), "w") as log:
            try:
                p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env=child_env())  # fmt: skip
                rc: int | str = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = "timeout"
        secs = time.perf_counter() - t0
        res: dict[str, Any] = {"rc": rc, "seconds": round(secs, 1)}
        try:
            with open(os.path.join(args.out, f"{name}.json")) as f:
                data = json.load(f)
            res["ok"] = data.get("ok")
            if "skipped" in data:
                res["skipped"] = data["skipped"]
        except (OSError, ValueError):
            res["ok"] = False
        summary["stages"][name] = res
        summary["total_seconds"] = round(time.perf_counter() - start, 1)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        with open(os.path.join(args.out, f"{name}.log")) as f:
            print(f.read()[-3000:], flush=True)
        print(f"== {name}: rc {rc}, {secs:.0f} s", flush=True)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
