"""How often a sampled request's first draft is the target's own draw, by how the draft is chosen:
the head's argmax, an inverse-CDF draw of the head's distribution on the target's uniform (one
uniform walked along the vocabulary, as the target drew before the race), and the exponential
race on the target's per-token noise (what a chain drafts since spec/draft_extend.py's
`DraftDraw`), against the most any rule can reach, sum(min(p, q)).

The served chain-3 engine (the packed default model and the built-in head) answers held-out
MT-bench prompts one at a time at temperature 1 with per-request seeds; at every iteration the
head's logits for its first draft and the target's verify row for the same position (the same
committed context) are kept. Then for each sampling setting (temperature, top-p, top-k applied
to both distributions, as a draft and the target apply them) the chance each rule drafts the
target's token is computed exactly per pair (the race's by Monte Carlo over fresh exponentials)
and averaged over the pairs.

    python bench/draft_coupling.py [--prompts 6] [--new-tokens 96] [--samples 64]
        [--out draft_coupling.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import machine, machine_info, print_table, write_json  # noqa: E402
from bench.gpu_table import chain  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.sampling.sampler import logits_to_probs  # noqa: E402
from eagleserve.sampling.sampling_info import SamplingInfo  # noqa: E402
from eagleserve.spec import accept, draft_extend  # noqa: E402

SETTINGS = {  # name -> (temperature, top_p, top_k or None)
    "T=1": (1.0, 1.0, None),
    "T=0.7 top_p=0.9": (0.7, 0.9, None),
    "T=1 top_p=0.95": (1.0, 0.95, None),
    "T=0.8 top_k=50": (0.8, 1.0, 50),
}


def first_draft_pairs(prompts: int, new_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target logits [V], head logits scattered to [V] with -inf elsewhere) per iteration: the
    first draft's head row and the verify row that draws the token it proposes."""
    eng = Engine(model="default", device="cpu", **chain(3))
    head = eng.scheduler.worker.drafter.head
    drafted: dict[int, torch.Tensor] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_draw, real_sample = draft_extend.drawn_candidate, accept.sample

    def record_draw(h: Any, logits: torch.Tensor, draw: Any) -> Any:
        full = logits.new_full((logits.shape[0], head.target_vocab_size), float("-inf"))
        full[:, head.target_ids] = logits.float()
        for row, pos in zip(full, draw.positions.tolist()):
            drafted[pos] = row.clone()
        return real_draw(h, logits, draw)

    def record_verify(rows: torch.Tensor, info: Any, at: torch.Tensor) -> torch.Tensor:
        first = min(drafted) if drafted else None  # the seed's position: its first draft
        for row, pos in zip(rows, at.tolist()):
            if pos == first:
                pairs.append((row.detach().float().clone(), drafted[pos]))
        drafted.clear()
        return real_sample(rows, info, at)

    draft_extend.drawn_candidate, accept.sample = record_draw, record_verify  # type: ignore
    try:
        qs = [data.chat_ids(eng.tokenizer, q) for q in data.mt_bench(prompts)]
        params = [SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=500 + i,
                                 ignore_eos=True) for i in range(len(qs))]  # fmt: skip
        for q, p in zip(qs, params):  # one at a time: each verify row 0 is the first draft's
            eng.generate([q], p)
    finally:
        draft_extend.drawn_candidate, accept.sample = real_draw, real_sample  # type: ignore
    return pairs


def distribution(logits: torch.Tensor, t: float, top_p: float, top_k: int | None) -> torch.Tensor:
    """One row's distribution by the sampler's own rule (`logits_to_probs`: temperature, top-k,
    top-p over the whole mass), normalized, in fp64."""
    info = SamplingInfo(
        temperatures=torch.full((1, 1), t),
        top_ps=torch.tensor([top_p]),
        top_ks=torch.tensor([top_k or logits.numel()]),
        min_ps=torch.zeros(1),
        is_greedy=[False],
        seeds=torch.zeros(1, dtype=torch.long),
        needs_top_k=top_k is not None,
        needs_top_p=top_p < 1.0,
        needs_min_p=False,
    )
    p = logits_to_probs(logits[None], info)[0].double()
    return p / p.sum()


def rule_rates(p: torch.Tensor, q: torch.Tensor, samples: int) -> dict[str, float]:
    """Chance each rule's draft from q is the target's draw from p (both [V], normalized)."""
    fp, fq = p.cumsum(0), q.cumsum(0)
    overlap = (torch.minimum(fp, fq) - torch.maximum(fp - p, fq - q)).clamp(min=0).sum()
    e = -torch.log(torch.rand(samples, p.numel(), dtype=torch.float64))
    race = ((e / p).argmin(1) == (e / q).argmin(1)).double().mean()
    return {"argmax": float(p[q.argmax()]), "inverse_cdf": float(overlap),
            "race": float(race), "best": float(torch.minimum(p, q).sum())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--samples", type=int, default=64, help="race draws per pair")
    ap.add_argument("--out", default="draft_coupling.json", help="file name in bench/results")
    args = ap.parse_args()
    pairs = first_draft_pairs(args.prompts, args.new_tokens)
    rows: list[dict[str, Any]] = []
    for name, (t, top_p, top_k) in SETTINGS.items():
        sums: dict[str, float] = {}
        for target, head in pairs:
            rates = rule_rates(distribution(target, t, top_p, top_k),
                               distribution(head, t, top_p, top_k), args.samples)  # fmt: skip
            for k, v in rates.items():
                sums[k] = sums.get(k, 0.0) + v
        rows.append({"setting": name, **{k: v / len(pairs) for k, v in sums.items()}})
    print(f"machine: {machine()}; {len(pairs)} first drafts")
    print_table(
        ["sampling", "argmax", "inverse CDF", "race", "sum min(p, q)"],
        [
            [r["setting"], *(f"{r[k]:.3f}" for k in ("argmax", "inverse_cdf", "race", "best"))]
            for r in rows
        ],  # fmt: skip
        title="chance the first draft is the target's draw",
    )
    path = write_json(args.out, dict(machine=machine_info(), args=vars(args), pairs=len(pairs),
                                     rows=rows))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
