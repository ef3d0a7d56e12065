"""The llama.cpp side of bench/cpu_vs_llamacpp.py: the same prompts, greedy, batch 1, through
llama-cpp-python (here when it imports, else in the llama.cpp venv of `make bench-llamacpp`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from typing import Any

# Runs in-process when llama_cpp imports, else as `python -c` in the llama.cpp venv (which has
# no torch / eagleserve): reads {gguf, threads, new_tokens, prompts} JSON on stdin.
LLAMA_WORKER = """
import json, sys, time
import llama_cpp
cfg = json.load(sys.stdin)
llm = llama_cpp.Llama(model_path=cfg["gguf"], n_ctx=2048, n_threads=cfg["threads"],
                      n_threads_batch=cfg["threads"], n_batch=512, verbose=False)
def gen(ids, n_new):
    llm.reset()  # no prefix reuse between prompts: every prompt pays its prefill
    out = []
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # greedy, never stops at EOS
        out.append(int(tok))
        if len(out) == n_new:
            break
    return out
gen(cfg["prompts"][0], 8)  # warm-up
tokens, secs, own_secs, decode_ms = [], [], [], []
for ids in cfg["prompts"]:
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    t0 = time.perf_counter()
    tokens.append(gen(ids, cfg["new_tokens"]))
    secs.append(time.perf_counter() - t0)
    # llama.cpp's own timers: its prompt and token evals, without the Python around them
    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    own_secs.append((perf.t_p_eval_ms + perf.t_eval_ms) / 1e3)
    decode_ms.append(perf.t_eval_ms / max(perf.n_eval, 1))
print(json.dumps(dict(tokens=tokens, secs=secs, own_secs=own_secs, decode_ms=decode_ms,
                      version=llama_cpp.__version__)))
"""


def run_llamacpp(
    prompt_ids: list[list[int]], args: argparse.Namespace, gguf: str
) -> dict[str, Any] | None:
    cfg = json.dumps(
        dict(gguf=gguf, threads=args.threads, new_tokens=args.new_tokens, prompts=prompt_ids)
    )
    if importlib.util.find_spec("llama_cpp") is not None:
        python = sys.executable  # a subprocess: its OpenMP runtime apart from torch's
    elif os.path.exists(args.llama_python):
        python = args.llama_python
    else:
        return None
    # llama.cpp runs at its own defaults: no thread wait policy or other setting that only one
    # side gets (run the benchmark alone on the machine instead).
    proc = subprocess.run(
        [python, "-c", LLAMA_WORKER], input=cfg, capture_output=True, text=True, check=True
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    n = sum(len(t) for t in out["tokens"])
    secs = sum(out["secs"])
    return dict(
        setting=f"llama.cpp {out['version']}",
        build_flags=build_flags(python),
        tok_s=n / secs,
        seconds=secs,
        new_tokens=n,
        tau=None,
        tokens=out["tokens"],
        own_timers_tok_s=n / sum(out["own_secs"]),
        own_timers_decode_ms=statistics.median(out["decode_ms"]),
    )


def build_flags(python: str) -> str:
    """The CMAKE_ARGS llama-cpp-python was built with (`make bench-llamacpp` writes them into
    the venv's BUILD_FLAGS), or 'unknown'."""
    path = os.path.join(os.path.dirname(os.path.dirname(python)), "BUILD_FLAGS")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"
