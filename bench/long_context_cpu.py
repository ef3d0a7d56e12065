"""Decode speed at long contexts on CPU: eagleserve's K/V cache in fp32 and in fp16 (the packed
target's default), beside llama.cpp at its defaults (its cache is fp16 too), one interleaved run.

    python bench/long_context_cpu.py [--contexts 128,1024,2048,4000] [--new-tokens 64]
        [--rounds 2] [--threads 2] [--out bench/results/long_context_cpu.json]

A prompt of the first `context` tokens of a long text (MT-bench's 80 questions, both turns,
one after another; the same token ids on both sides), then `--new-tokens` greedy tokens with
EOS ignored, batch 1, the default model (SmolLM2-135M-Instruct's Q4_1 GGUF). eagleserve runs
through its scheduler's steps with the prefix cache off: time to first token covers the
(chunked) prefill, the decode time per token everything after it, host work included.
llama.cpp (llama-cpp-python, from the venv of `make bench-llamacpp` where it does not import
here) reports its own timers: prompt eval and eval per token, without the Python around them.
Median of `--rounds`, the order rotated one place per round (`common.rotated`). Then, per
context, eagleserve's target forward alone (bench/cpu_vs_llamacpp.py's `verify_costs`): a decode
and verifies of 2-4 tokens, what a speculative iteration's verify costs against a decode. And
what the cache's type costs in quality: each setting's perplexity of the text's `context` tokens
(its prompt log-probabilities) beside the de-quantized fp32 model's (`--quantization none`, an
fp32 cache), and the mean |difference| of their per-token log-probabilities."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, machine_info, print_table, rotated, write_json  # noqa: E402
from bench.cpu_vs_llamacpp import verify_costs  # noqa: E402
from bench.data import mt_bench_turns  # noqa: E402
from bench.llamacpp_run import build_flags  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.messages import GenerateReqInput  # noqa: E402
from eagleserve.models.loader import default_gguf_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in the llama.cpp venv: {gguf, threads, new_tokens, prompts} JSON on stdin.
LLAMA_WORKER = """
import json, sys
import llama_cpp
cfg = json.load(sys.stdin)
n_ctx = max(len(p) for p in cfg["prompts"]) + cfg["new_tokens"] + 16
llm = llama_cpp.Llama(model_path=cfg["gguf"], n_ctx=n_ctx, n_threads=cfg["threads"],
                      n_threads_batch=cfg["threads"], verbose=False)
rows = []
for ids in cfg["prompts"]:
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    out = []
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(int(tok))
        if len(out) == cfg["new_tokens"]:
            break
    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    rows.append(dict(prefill_s=perf.t_p_eval_ms / 1e3,
                     decode_ms=perf.t_eval_ms / max(perf.n_eval, 1)))
print(json.dumps(dict(rows=rows, version=llama_cpp.__version__)))
"""


def eagleserve_run(engine: Engine, ids: list[int], new_tokens: int) -> dict[str, float]:
    """One request through the scheduler's steps: seconds to its first token, then ms per token."""
    sched = engine.scheduler
    rid = f"long-{time.monotonic_ns()}"
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    sched.add_request(GenerateReqInput(rid, list(ids), params))
    got, first, t_first, t_end = 0, 0, 0.0, 0.0
    while not t_end:
        for out in sched.step():
            if out.rid != rid:
                continue
            got += len(out.new_token_ids)
            if not first and got:
                first, t_first = got, time.perf_counter()
            if out.finished:
                t_end = time.perf_counter()
    while sched.has_work():  # nothing left in flight before the next request
        sched.step()
    assert got == new_tokens, (got, new_tokens)
    return dict(prefill_s=t_first - t0, decode_ms=1e3 * (t_end - t_first) / (got - first))


def long_text_ids(engine: Engine, n: int) -> list[int]:
    """The first n tokens of MT-bench's questions, both turns, in file order."""
    text = "\n\n".join(mt_bench_turns())
    ids = engine.tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than the context {n}")
    return ids[:n]


def prompt_logprobs(engine: Engine, ids: list[int]) -> list[float]:
    """Log-probability of each token of ids after the ones before it (the first has none)."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=0)
    return engine.generate([ids], params)[0]["prompt_logprobs"][1:]


def llamacpp_run(prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any] | None:
    try:
        import llama_cpp  # noqa: F401

        python = sys.executable
    except ImportError:
        python = args.llama_python
        if not os.path.exists(python):
            return None
    cfg = dict(gguf=default_gguf_path(), threads=args.threads, new_tokens=args.new_tokens,
               prompts=prompts)  # fmt: skip
    proc = subprocess.run([python, "-c", LLAMA_WORKER], input=json.dumps(cfg),
                          capture_output=True, text=True, check=True)  # fmt: skip
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["build_flags"] = build_flags(python)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", default="128,1024,2048,4000")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--forward-reps", type=int, default=15, help="timings of each forward")
    ap.add_argument("--llama-python", default=os.path.join(ROOT, ".venv-llamacpp/bin/python"))
    ap.add_argument("--out", default="long_context_cpu.json", help="file name in bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"machine: {machine()}")
    kv_tokens = max(contexts) + args.new_tokens + 64
    engines = {
        f"eagleserve, {dtype.removeprefix('float')}-bit K/V": Engine(
            model="default",
            device="cpu",
            max_total_tokens=kv_tokens,
            max_running_requests=1,
            context_length=kv_tokens,
            disable_radix_cache=True,
            kv_cache_dtype=dtype,
        )  # fmt: skip
        for dtype in ("float32", "float16")
    }
    prompts = [long_text_ids(next(iter(engines.values())), n) for n in contexts]
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in engines}
    llama: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for name in rotated([*engines, "llama.cpp"], r):  # llama.cpp in every place in turn
            if name != "llama.cpp":
                runs[name].append([eagleserve_run(engines[name], p, args.new_tokens)
                                   for p in prompts])  # fmt: skip
            elif (out := llamacpp_run(prompts, args)) is not None:
                llama.append(out)
            else:
                continue
            print(f"round {r + 1}: {name} done", flush=True)
    if llama:
        runs[f"llama.cpp {llama[0]['version']}"] = [o["rows"] for o in llama]

    def med(name: str, i: int, key: str) -> float:
        return statistics.median(rnd[i][key] for rnd in runs[name])

    llama_name = next((n for n in runs if n.startswith("llama.cpp")), None)
    rows, table = [], []
    for i, n in enumerate(contexts):
        for name in runs:
            ms = med(name, i, "decode_ms")
            vs = med(llama_name, i, "decode_ms") / ms if llama_name else None
            rows.append(dict(context=n, setting=name, decode_ms=ms, tok_s=1e3 / ms,
                             x_llamacpp=vs, prefill_s=med(name, i, "prefill_s")))  # fmt: skip
            table.append([n, name, f"{ms:.2f}", f"{1e3 / ms:.1f}",
                          f"{vs:.2f}x" if vs else "", f"{rows[-1]['prefill_s']:.2f}"])  # fmt: skip
    print_table(
        ["context", "setting", "decode ms/token", "tok/s", "x llama.cpp", "prefill s"],
        table,
        title=f"batch 1, {args.new_tokens} new tokens, {args.threads} threads",
    )
    forwards, table = [], []
    for n in contexts:
        for name, engine in engines.items():
            ms = verify_costs(engine, n, args.forward_reps)
            forwards.append(dict(context=n, setting=name, **ms))
            table.append([n, name, *(f"{v:.2f}" for v in ms.values()),
                          f"{ms['verify4_ms'] / ms['decode_ms']:.2f}x"])  # fmt: skip
    print_table(["context", "setting", "decode ms", "verify 2", "verify 3", "verify 4",
                 "verify 4 / decode"], table, title="one target forward (median)")  # fmt: skip
    dense = Engine(model="default", device="cpu", quantization="none", dtype="float32",
                   max_total_tokens=kv_tokens, max_running_requests=1, context_length=kv_tokens,
                   disable_radix_cache=True)  # fmt: skip
    quality, table = [], []
    for p in prompts:
        ref = torch.tensor(prompt_logprobs(dense, p), dtype=torch.float64)
        ppl = float(torch.exp(-ref.mean()))
        table.append([len(p), "de-quantized fp32 model", f"{ppl:.3f}", ""])
        quality.append(dict(context=len(p), setting="de-quantized fp32 model", ppl=ppl))
        for name, engine in engines.items():
            lp = torch.tensor(prompt_logprobs(engine, p), dtype=torch.float64)
            row = dict(context=len(p), setting=name, ppl=float(torch.exp(-lp.mean())),
                       mean_abs_logprob_diff=float((lp - ref).abs().mean()))  # fmt: skip
            quality.append(row)
            table.append([len(p), name, f"{row['ppl']:.3f}", f"{row['mean_abs_logprob_diff']:.4f}"])
    print_table(["context", "setting", "perplexity", "mean |logprob - fp32 model's|"], table,
                title="the text's own tokens")  # fmt: skip
    path = write_json(args.out, dict(
        machine=machine_info(), contexts=contexts, new_tokens=args.new_tokens,
        threads=args.threads, rounds=args.rounds, rows=rows, runs=runs, forwards=forwards,
        quality=quality,
        llama_build_flags=llama[0]["build_flags"] if llama else None,
    ))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
