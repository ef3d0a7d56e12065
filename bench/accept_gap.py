"""Served acceptance next to teacher-forced head accuracy on the very same token sequences.

For each held-out set (MT-bench first turns, HumanEval, math, and with `--sets` the first
turns of train-draft's held-out ShareGPT conversations or MT-bench questions spread over its
categories; never trained on): the served
target (packed GGUF) answers greedily (`--new-tokens`, EOS ignored); the EAGLE engine (chain of 3)
produces the same tokens and reports P(accept >= d) per verify; then the target runs teacher-
forced over prompt + answer (train-draft's extraction) and the head is scored position by
position on the answer (train-draft --eval-head: depth d given correct earlier tokens, the
head's own features fed back). If the two agree, the head's quality on this text, not the
serving path, sets the acceptance. Teacher-forced accuracy is given over the rows whose target
argmax the head can draft (in its vocabulary) and over every row (an argmax outside it a miss:
what serving sees).

`--target-dtypes auto,float32` serves each set twice: with the default model as served on a
CPU ("auto": the packed 4-bit weights, whose kernels quantize activations to int8 per block,
as llama.cpp does) and with the same weights de-quantized ("float32", the target train-draft
extracts its features from). Each row's teacher-forced accuracy is on that row's own tokens,
from float32 features. Served acceptance that is lower with "auto" than with "float32" is the
cost of serving on features the head was not trained on.

    python bench/accept_gap.py [--prompts-per-set 8] [--new-tokens 96] [--threads 2]
        [--target-dtypes auto] [--out accept_gap.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import machine, print_table, write_json  # noqa: E402
from bench.spec_cpu import run_engine  # noqa: E402
from eagleserve import Engine  # noqa: E402
from eagleserve.models.llama import LlamaForCausalLM  # noqa: E402
from eagleserve.train.extract import extract, self_distilled_items  # noqa: E402
from eagleserve.train.shards import ShardWriter  # noqa: E402
from eagleserve.train.target import load_target, target_layer_ids  # noqa: E402
from eagleserve.train.tf_train import head_accuracy  # noqa: E402

# Whole chains: every verify judges every depth (the default cuts unsure chains short).
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
             speculative_min_path_prob=0.0)  # fmt: skip
DEPTHS = 3
TOP_K = 32  # the target's top-k kept per position, as train-draft extracts them


def extract_answers(
    target: LlamaForCausalLM,
    layers: tuple[int, ...],
    seqs: list[list[int]],
    lens: list[int],
    shard_dir: str,
    name: str,
) -> None:
    """train-draft's extraction (fp32 target features and top-k) of prompt + answer sequences
    (`seqs`, each answer after its `lens` prompt tokens) into shards at `shard_dir`."""
    meta = {"layer_ids": list(layers), "k": TOP_K, "extract_dtype": "float32", "sources": name}
    writer = ShardWriter(shard_dir, 65536, meta)
    extract(target, self_distilled_items(seqs, lens), writer, layers, TOP_K, 10**9, 1e9, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    data.add_head_set_args(ap, prompts_per_set=8, sets=data.DEFAULT_SETS)
    ap.add_argument("--target-dtypes", default="auto",
                    help="comma-separated: auto (packed, as served), float32")  # fmt: skip
    ap.add_argument("--out", default="accept_gap.json", help="file name in bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.prompts_per_set
    sets = data.sets_of(args)
    served, sequences = {}, {}
    for dtype in args.target_dtypes.split(","):
        kw = dict(model="default", device="cpu", max_total_tokens=4096, max_running_requests=2,
                  disable_overlap_schedule=True, dtype=dtype)  # fmt: skip
        base = Engine(**kw)
        eagle = Engine(**kw, speculative_algorithm="EAGLE3",
                       speculative_draft_model_path=args.head, **CHAIN)  # fmt: skip
        for name, prompts in sets.items():
            ids = [data.chat_ids(base.tokenizer, p) for p in prompts]
            b = run_engine(base, ids, 1, args.new_tokens)
            e = run_engine(eagle, ids, 1, args.new_tokens)
            served[name, dtype] = dict(tau=e["tau"], accept=e["accept_by_depth"],
                                       lossless=e["tokens"] == b["tokens"])  # fmt: skip
            sequences[name, dtype] = ([i + t for i, t in zip(ids, b["tokens"])],
                                      [len(i) for i in ids])  # fmt: skip
        del base, eagle
    target, _ = load_target("default", "float32", 2048)
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for (name, dtype), (seqs, lens) in sequences.items():
            shard_dir = os.path.join(tmp, f"{name}-{dtype}")
            extract_answers(target, layers, seqs, lens, shard_dir, name)
            ns = SimpleNamespace(model="default", eval_head=args.head, algorithm="EAGLE3",
                                 shards=[shard_dir], out=os.path.join(tmp, f"eval_{name}_{dtype}"),
                                 max_len=512, batch_size=8, ttt_steps=DEPTHS, seed=0)  # fmt: skip
            tf = head_accuracy(ns)
            rows.append(dict(set=name, target_dtype=dtype, **served[name, dtype],
                             teacher_forced=[tf[f"acc{d}"] for d in range(DEPTHS)],
                             teacher_forced_all=[tf[f"acc{d}_all"] for d in range(DEPTHS)],
                             outside_draft_vocab=tf["argmax_outside_draft_vocab"]))  # fmt: skip
    print(f"machine: {machine()}; head {args.head}; chain 3, batch 1, greedy, "
          f"{args.new_tokens} new tokens, {n} prompts per set")  # fmt: skip
    print_table(
        ["set", "target", "tau", "served P(accept >= d)", "teacher-forced acc by depth",
         "over all rows", "outside vocab", "lossless"],
        [[r["set"], r["target_dtype"], f"{r['tau']:.2f}", " ".join(f"{a:.3f}" for a in r["accept"]),
          " ".join(f"{a:.3f}" for a in r["teacher_forced"]),
          " ".join(f"{a:.3f}" for a in r["teacher_forced_all"]), f"{r['outside_draft_vocab']:.1%}",
          str(r["lossless"])] for r in rows],
    )  # fmt: skip
    write_json(args.out, {"args": vars(args), "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
