"""GPU benchmark (run on a lent GPU): a Llama-3-8B-shaped target and an EAGLE-3-shaped head with
random weights built on the device (nothing is downloaded).

    PYTHONPATH=. python bench/gpu.py [--layers 32] [--out bench/results/gpu.json]

Reports: target-only decode tokens/s at batch 1, 8 and 32 against transformers' `generate` on the
same weights and against the bandwidth floor (weight bytes / measured device bandwidth), and with
--deterministic the same decode rows with --enable-deterministic-inference (with --pdl, with
--enable-pdl); the cost of the
draft stage (a 3-step chain) and one verify relative to one target decode; kernel launches per
speculative iteration with the compiled spec-extras gather and the top-k=1 chain buffers on and off.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

from eagleserve import Engine, SamplingParams
from eagleserve.device import pick_device, synchronize
from eagleserve.layers.forward_batch import ForwardBatch, HostLens
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head
from eagleserve.spec.tree import Topk1ChainBuffers


def llama3_8b_config(layers: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    }


def device_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    synchronize(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def prompts(bs: int, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, vocab - 1000, (n,), generator=g).tolist() for _ in range(bs)]


def engine_tok_s(engine: Engine, bs: int, new: int, vocab: int) -> tuple[float, list]:
    p = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    engine.generate(prompts(bs, 128, vocab, 1), SamplingParams(max_new_tokens=8, temperature=0))
    synchronize(engine.scheduler.device)
    t0 = time.perf_counter()
    out = engine.generate(prompts(bs, 128, vocab), p)
    synchronize(engine.scheduler.device)
    return bs * new / (time.perf_counter() - t0), out


def hf_tok_s(model: torch.nn.Module, bs: int, new: int, vocab: int, device: torch.device) -> float:
    ids = torch.tensor(prompts(bs, 128, vocab), device=device)
    model.generate(ids[:, :16], max_new_tokens=8, do_sample=False)
    synchronize(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    synchronize(device)
    return bs * new / (time.perf_counter() - t0)


class CallTimer:
    """Wraps a method; records synchronized wall time per call, keyed by a label function."""

    def __init__(self, obj: Any, name: str, device: torch.device, label: Any = None) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        real = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            synchronize(device)
            t0 = time.perf_counter()
            out = real(*args, **kwargs)
            synchronize(device)
            key = label(*args, **kwargs) if label else name
            self.times[key].append(time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)

    def mean_ms(self, key: str) -> float:
        ts = self.times[key][2:] or self.times[key]  # skip warm-up calls
        return 1000 * sum(ts) / max(len(ts), 1)


def kernel_launches(engine: Engine, vocab: int, iters: int = 8) -> float:
    from torch.profiler import ProfilerActivity, profile

    p = SamplingParams(max_new_tokens=iters * 4, temperature=0.0, ignore_eos=True)
    engine.generate(prompts(4, 64, vocab, 2), SamplingParams(max_new_tokens=8, temperature=0))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts(4, 64, vocab, 3), p)
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return kernels / max(engine.stats().spec_verify_calls_total / 4, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/gpu.json")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--deterministic", action="store_true", help="also decode in the batch-invariant mode"
    )
    ap.add_argument("--pdl", action="store_true", help="also decode with --enable-pdl")
    args = ap.parse_args()
    device = pick_device("auto")
    assert device.type != "cpu", "bench/gpu.py needs a GPU"
    name = torch.get_device_module(device).get_device_name(device)
    tmp = tempfile.mkdtemp()
    cfg = llama3_8b_config(args.layers)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    common = dict(
        device=str(device),
        dtype="bfloat16",
        load_format="dummy",
        max_total_tokens=65536,
        max_running_requests=32,
        context_length=4096,
    )
    vocab = cfg["vocab_size"]
    res: dict[str, Any] = {"device": name, "torch": torch.__version__, "layers": args.layers}

    eng = Engine(model=tmp, **common)
    model = eng.scheduler.worker.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = device_bandwidth(device)
    res["weight_gb"], res["bandwidth_gb_s"] = weight_bytes / 1e9, bw / 1e9
    rows = []
    for bs in (1, 8, 32):
        tok_s, _ = engine_tok_s(eng, bs, args.new_tokens, vocab)
        rows.append({"batch": bs, "eagleserve_tok_s": tok_s, "floor_tok_s": bs * bw / weight_bytes})
    if not args.skip_hf:
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device(device):
            hf = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
        hf.load_state_dict(model.state_dict(), strict=False)
        for row in rows:
            row["hf_tok_s"] = hf_tok_s(hf, row["batch"], args.new_tokens, vocab, device)
        del hf
    res["decode"] = rows
    _save(res, args.out)
    # Other settings' decode rows, each on an engine of its own after the default one.
    others = {"deterministic": dict(enable_deterministic_inference=True),
              "pdl": dict(enable_pdl=True)}  # fmt: skip
    for key, kw in others.items():
        if not getattr(args, key):
            continue
        if eng is not None:
            eng.close()
        eng = None
        torch.get_device_module(device).empty_cache()
        other = Engine(model=tmp, **kw, **common)
        for row in rows:
            tok_s, _ = engine_tok_s(other, row["batch"], args.new_tokens, vocab)
            row[f"{key}_tok_s"] = tok_s
            row[f"{key}_vs_off"] = tok_s / row["eagleserve_tok_s"]
        other.close()
        del other
        _save(res, args.out)

    # Draft step and verify cost relative to one target decode (batch 1, chain of 3).
    head_dir = os.path.join(tmp, "eagle3-head")
    head = init_eagle_head("EAGLE3", model, draft_vocab_size=32000, seed=0)
    save_eagle_head(head, head_dir)
    del head, eng, model
    spec = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head_dir,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )
    seng = Engine(model=tmp, disable_overlap_schedule=True, **common, **spec)
    w = seng.scheduler.worker
    fwd = CallTimer(w.runner, "forward", device, label=lambda fb, *a, **k: fb.mode)
    # the whole draft stage: with the draft-loop graph its steps are one replay, not `_step` calls
    draft = CallTimer(w.drafter, "draft", device)
    seng.generate(
        prompts(1, 128, vocab), SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    )
    teng_runner = seng.scheduler.worker.runner
    decode_ms = _decode_ms(teng_runner, device)
    res["costs_ms"] = {
        "target_decode": decode_ms,
        "draft_3_steps": draft.mean_ms("draft"),
        "verify_4_tokens": fwd.mean_ms("verify"),
    }
    res["costs_rel"] = {k: v / decode_ms for k, v in res["costs_ms"].items()}
    _save(res, args.out)
    del seng

    # Kernel launches per speculative iteration (overlap on, batch 4).
    launches = {}
    for compiled in (True, False):
        for chain_buffers in (True, False):
            os.environ["EAGLESERVE_DISABLE_COMPILE"] = "0" if compiled else "1"
            e = Engine(model=tmp, disable_cuda_graph=True, **common, **spec)
            if not chain_buffers:
                e.scheduler.worker.drafter.chain_buffers = {3: Topk1ChainBuffers(0, 3, 4, device)}
            launches[f"compiled={compiled},chain_buffers={chain_buffers}"] = kernel_launches(
                e, vocab
            )
            del e
    res["kernel_launches_per_iteration"] = launches
    print(
        f"device: {name}; weights {res['weight_gb']:.1f} GB; "
        f"bandwidth {res['bandwidth_gb_s']:.0f} GB/s"
    )
    print(f"{'batch':>6}{'eagleserve':>12}{'transformers':>14}{'floor':>10}{'deterministic':>15}"
          f"{'pdl':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['batch']:>6}{r['eagleserve_tok_s']:>12.1f}{r.get('hf_tok_s', 0):>14.1f}"
            f"{r['floor_tok_s']:>10.1f}{r.get('deterministic_tok_s', 0):>15.1f}"
            f"{r.get('pdl_tok_s', 0):>10.1f}"
        )
    for k, v in res["costs_ms"].items():
        print(f"{k:<18}{v:8.2f} ms  ({res['costs_rel'][k]:.2f}x decode)")
    for k, v in launches.items():
        print(f"kernel launches/iteration {k}: {v:.0f}")
    _save(res, args.out)


def _save(res: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=2)


def _decode_ms(runner: Any, device: torch.device, iters: int = 20) -> float:
    """One batch-1 target decode forward over a 128-token context, synchronized."""
    r2t = runner.req_to_token_pool
    kv = runner.token_to_kv_pool
    idx = r2t.alloc()
    loc = kv.alloc(129)
    r2t.req_to_token[idx, :129] = loc
    one = torch.ones(1, dtype=torch.long, device=device)
    fb = lambda: ForwardBatch(
        mode="decode",
        input_ids=one * 1000,
        positions=one * 128,
        out_cache_loc=loc[128:129],
        req_pool_indices=one * idx,
        prefix_lens=one * 128,
        extend_lens=one,
        host=HostLens.per_request(1, 128, 1),
        kv_pool=kv,
        attn_backend=runner.attn_backend,
    )
    for _ in range(3):
        runner.forward(fb())
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        runner.forward(fb())
    synchronize(device)
    kv.free(loc)
    r2t.free(idx)
    return 1000 * (time.perf_counter() - t0) / iters


if __name__ == "__main__":
    main()
