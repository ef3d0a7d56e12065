"""Does torch.compile shorten a CPU decode step? Eager vs compiled, same engine, one run.

    python bench/compile_cpu.py [--batches 1,4] [--new-tokens 64] [--rounds 3] [--quantization gguf]

The default model's decode forward (embedding, 30 layers, final norm) is compiled with
`torch.compile(dynamic=False)` (inductor, C++ kernels), one graph per batch size. Attention stays
eager: it reads the paged KV through per-forward metadata whose shapes change every step, so it
is a graph break (`torch._dynamo.disable`). Prefill stays eager. Tokens/s = new tokens / wall
time of the whole call, median of `--rounds` interleaved rounds after a warm-up (which pays the
compilation). Prints a table and writes bench/results/compile_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, machine_info, median, print_table, write_json  # noqa: E402
from bench.data import mt_bench  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.layers.forward_batch import get_forward_batch  # noqa: E402
from eagleserve.models import llama  # noqa: E402


@torch._dynamo.disable
def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> Any:
    fb = get_forward_batch()
    return fb.attn_backend.forward(q, k, v, layer_id, fb)


def compile_decode(engine: Engine) -> None:
    """Routes this engine's decode forwards through a compiled body; other modes stay eager.
    The body is LlamaForCausalLM.forward's layer loop with attention behind a graph break."""
    model = engine.scheduler.worker.runner.model
    inner = model.model

    def body(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = inner.embed_tokens(input_ids)
        rotary = inner.rotary_emb.at(positions, h.dtype)
        for layer in inner.layers:
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(h), positions, rotary)
            out = _eager_attention(q, k, v, attn.layer_id)
            h = h + attn.o_proj(out.reshape(h.shape[0], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return inner.norm(h)

    compiled = torch.compile(body, dynamic=False)
    eager_forward = model.forward

    def forward() -> llama.ModelOutput:
        fb = get_forward_batch()
        if fb.mode != "decode":
            return eager_forward()
        h = compiled(fb.input_ids, fb.positions)
        return llama.ModelOutput(model.compute_logits(h), h, None)

    model.forward = forward


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[Any]]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return len(prompts) * new_tokens / (time.perf_counter() - t0), [o["token_ids"] for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="gguf", help="gguf (packed int4) or none (fp32)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    weights = {"quantization": "gguf"} if args.quantization == "gguf" else {"dtype": "float32"}
    common = dict(device="cpu", max_running_requests=max(batches), max_total_tokens=8192)
    engines = {name: Engine(model="default", **common, **weights) for name in ("eager", "compiled")}
    compile_decode(engines["compiled"])
    tok = engines["eager"].tokenizer
    chat = [[{"role": "user", "content": p}] for p in mt_bench(max(batches))]
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for c in chat]  # fmt: skip
    print(f"machine: {machine()}")
    rows, results = [], []
    for bs in batches:
        sub = prompts[:bs]
        warm = {}
        for name, eng in engines.items():
            t0 = time.perf_counter()
            run(eng, sub, args.new_tokens)  # warm-up; compiles the batch size's graph
            warm[name] = time.perf_counter() - t0
        tps: dict[str, list[float]] = {name: [] for name in engines}
        toks: dict[str, Any] = {}
        for _ in range(args.rounds):
            for name, eng in engines.items():
                rate, toks[name] = run(eng, sub, args.new_tokens)
                tps[name].append(rate)
        same = toks["eager"] == toks["compiled"]
        for name in engines:
            rows.append([name, bs, median(tps[name]), 1000 * bs / median(tps[name]), warm[name]])
            results.append(dict(mode=name, batch=bs, tokens_per_s=tps[name],
                                warmup_s=warm[name], tokens_equal_to_eager=same))  # fmt: skip
    print_table(
        ["forward", "batch", "tok/s", "ms/token", "warm-up s"],
        rows,
        title=f"decode, {args.new_tokens} new tokens, {args.quantization} -- {machine()}",
    )
    path = write_json("compile_cpu.json", dict(benchmark="compile_cpu", machine=machine_info(),
                                               quantization=args.quantization,
                                               results=results))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
