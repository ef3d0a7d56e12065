"""Does the K/V cache's type change what the head drafts right? Teacher-forced on one fixed text.

Served acceptance with two cache types cannot be compared prompt by prompt: the packed target's
greedy answer changes wherever any bit of its forward does, and with it the text the head
drafts on (`bench/accept_cpu.py --kv-cache-dtype float32,float16` pairs the prompts whose
answers stay equal: few do). Here the text is fixed: each prompt with the target's greedy
answer under the first cache type. The served target (packed GGUF, its serving forward, K/V
written to and read from the pool of each type) runs over prompt + answer once per cache type;
its features (the EAGLE3 aux states) and its greedy token at every position come from that
forward. The head then drafts depth 0 at every answer position from those features, teacher
forced (train-draft's `head_step`, the head in fp32 for both), and is scored against the same
forward's greedy tokens (what a verify under that cache would accept; a token outside the draft
vocabulary is a miss). Per set: depth-0 accuracy under each cache, the positions where the
target's own greedy token differs between the caches, and the hits one cache has and the other
misses.

    python bench/kv_cache_accept.py [--kv-cache-dtypes float32,float16] [--prompts-per-set 20]
        [--new-tokens 96] [--out kv_cache_accept.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import machine, print_table, write_json  # noqa: E402
from bench.forwards import scratch_batch, scratch_request  # noqa: E402
from bench.spec_cpu import run_engine  # noqa: E402
from eagleserve import Engine  # noqa: E402
from eagleserve.models.loader import resolve_draft_path  # noqa: E402
from eagleserve.spec.head_loader import load_eagle_head  # noqa: E402
from eagleserve.train.ttt import head_step, lm_head_weight  # noqa: E402

# Whole chains: every verify judges every depth (the default cuts unsure chains short).
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
             speculative_min_path_prob=0.0)  # fmt: skip


@torch.inference_mode()
def served_features(engine: Engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux features [T, 3 * hidden], greedy token of each row [T]) of the engine's target over
    `ids` in one serving forward (every row's logits, as a verify computes them), its K/V in
    scratch slots of the engine's pool."""
    runner = engine.scheduler.worker.runner
    with scratch_request(runner, len(ids)) as row:
        out = runner.forward(scratch_batch(runner, row, torch.tensor(ids), 0))
        assert out.aux_hidden_states is not None, "an EAGLE3 engine's target keeps its aux states"
        return out.aux_hidden_states.float().clone(), out.logits.argmax(-1)


@torch.no_grad()
def depth0_hits(head: object, ids: list[int], feats: torch.Tensor, greedy: torch.Tensor,
                first: int) -> torch.Tensor:  # fmt: skip
    """Hit of the head's depth-0 draft for each token from `first` on (the answer's): from row
    j's features and token j + 1 it drafts token j + 2, which the target's row j + 1 decides."""
    t = len(ids) - 2
    x = torch.tensor(ids[1 : 1 + t])[None]
    hid, _, _ = head_step(head, x, feats[None, :t], torch.arange(t)[None], [], "dense")
    pred = torch.nn.functional.linear(hid[0], lm_head_weight(head)).argmax(-1)
    drafted = head.to_target_ids(pred)  # type: ignore[attr-defined]
    return (drafted == greedy[1 : 1 + t])[first - 2 :]


def compare(engines: dict[str, Engine], head: object, name: str, source: str,
            prompts: list[list[int]], answers: list[list[int]]) -> dict:  # fmt: skip
    """One set's row: the head's depth-0 hits under each cache on prompts + `answers` (the
    greedy answers under the `source` cache)."""
    cache_types = list(engines)
    hits: dict[str, list[torch.Tensor]] = {kv: [] for kv in cache_types}
    label_diff = reproduced = 0
    for prompt, answer in zip(prompts, answers):
        ids = prompt + answer
        greedy = {}
        for kv, eng in engines.items():
            feats, greedy[kv] = served_features(eng, ids)
            hits[kv].append(depth0_hits(head, ids, feats, greedy[kv], len(prompt)))
        a, b = (greedy[kv][len(prompt) - 1 : len(ids) - 1] for kv in cache_types)
        label_diff += int((a != b).sum())
        # The forward is the served one: under the answer's own cache it decodes the answer.
        own = greedy[source][len(prompt) - 1 : len(ids) - 1]
        reproduced += int((own == torch.tensor(answer)).sum())
    h = {kv: torch.cat(v) for kv, v in hits.items()}
    a, b = (h[kv] for kv in cache_types)
    return dict(set=name, answers_from=source, prompts=len(prompts), positions=int(a.numel()),
                answer_reproduced=reproduced / max(1, int(a.numel())),
                accuracy={kv: float(v.float().mean()) for kv, v in h.items()},
                greedy_differs=label_diff, hits_only_first=int((a & ~b).sum()),
                hits_only_second=int((b & ~a).sum()))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    data.add_head_set_args(ap, prompts_per_set=20, sets=data.DEFAULT_SETS)
    ap.add_argument("--kv-cache-dtypes", default="float32,float16")
    ap.add_argument("--out", default="kv_cache_accept.json", help="file name in bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cache_types = args.kv_cache_dtypes.split(",")
    if len(cache_types) != 2:
        ap.error("--kv-cache-dtypes: two types, e.g. float32,float16")
    head_path = resolve_draft_path(args.head)
    kw = dict(model="default", device="cpu", max_total_tokens=4096, max_running_requests=2,
              disable_overlap_schedule=True, disable_radix_cache=True,  # scratch slots free
              speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head_path, **CHAIN)  # fmt: skip
    engines = {kv: Engine(**kw, kv_cache_dtype=kv) for kv in cache_types}
    first = engines[cache_types[0]]
    target = first.scheduler.worker.runner.model
    head = load_eagle_head(head_path, "EAGLE3", target, torch.device("cpu"), torch.float32).eval()
    rows = []
    for name, texts in data.sets_of(args).items():
        prompts = [data.chat_ids(first.tokenizer, p) for p in texts]
        for source in cache_types:  # the text: the answers under each cache in turn
            answers = run_engine(engines[source], prompts, 1, args.new_tokens)["tokens"]
            rows.append(compare(engines, head, name, source, prompts, answers))
    a, b = cache_types
    print(f"machine: {machine()}; head {args.head} (fp32, teacher-forced depth 0); answers: the "
          f"packed target's greedy {args.new_tokens} tokens with each cache")  # fmt: skip
    print_table(
        ["set", "answers from", "positions", "answer reproduced", f"accuracy {a}",
         f"accuracy {b}", "greedy token differs", f"hits {a} only", f"hits {b} only"],
        [[r["set"], r["answers_from"], r["positions"], f"{r['answer_reproduced']:.0%}",
          f"{r['accuracy'][a]:.4f}", f"{r['accuracy'][b]:.4f}", r["greedy_differs"],
          r["hits_only_first"], r["hits_only_second"]] for r in rows],
    )  # fmt: skip
    write_json(args.out, {"args": vars(args), "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
