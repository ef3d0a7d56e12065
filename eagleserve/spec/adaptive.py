"""Adaptive speculation: per decode iteration, the draft depth k that maximises expected committed
tokens per second, from live acceptance and measured cost: a chain stops at any k in 0..num_steps,
a tree is drafted whole (k = num_steps) or not at all (k = 0, a plain decode).

- Acceptance, per request: `alphas[d]` = P(draft at depth d+1 accepted | drafts before it were),
  an EMA updated from every verify the request takes part in (`update_acceptance`), starting
  from the engine-wide EMA (what the head achieved on recent requests), which starts from the
  head's own held-out accuracy by depth where its training log has it (`acceptance_prior`):
  deep depths are judged only after every shallower draft was accepted, so their EMAs move
  rarely and a made-up start would steer the controller for a long time.
- Expected committed tokens of one request with a k-chain (the bonus token always counts):
  E[k] = 1 + sum_{j=1..k} prod_{d<j} alphas[d]  (`expected_tokens`, every k at once); for a
  tree the same sum over its per-depth acceptance (the accepted path is a chain through the tree).
- Cost: `CostTable` holds the seconds of one decode iteration per batch-size bucket and k,
  measured at start-up and scaled per bucket by an EMA of measured iterations.
- `choose_num_drafts`: argmax_k sum_r E_r[k] / cost(bs, k); k = 0 is a plain target decode,
  and a draft must beat it by DRAFT_MARGIN: acceptance is an estimate (the head's held-out
  accuracy runs above what it achieves on live text, and deep depths are rarely judged), so
  a draft predicted to pay by less is as likely to lose, and losing is what speculation must
  not do. A plain decode given up for a draft that pays by less costs at most that margin.

A request that never drafts never updates its acceptance, so after a stretch without drafts one
iteration drafts regardless, at the shallowest depth (the price of noticing that acceptance went
up; once the first depth pays, the controller goes deeper by itself where the deeper EMAs say
so). The stretch is `probe_interval` iterations, or longer where a probe costs more than
PROBE_SHARE of the decodes between probes (`iterations_between_probes`): a probe drafts for the
whole batch and catches up every request's held head inputs, which grows with the batch. Each
probe after which the controller still does not draft by itself doubles the stretch, up to
MAX_PROBE_BACKOFF times: where drafting keeps not paying, probing less is what is left to gain.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Weight of the newest verify in a request's acceptance EMA.
ACCEPT_EMA = 0.2
# Acceptance assumed at every depth before the engine has verified anything.
ACCEPT_PRIOR = 0.5
# Weight of the newest measured iteration in a cost EMA.
COST_EMA = 0.1
# How much more expected tokens per second a draft must promise than a plain decode.
DRAFT_MARGIN = 0.05
# Most of the decode time that probes may add, and how far failed probes stretch the time
# between them (see module).
PROBE_SHARE = 0.01
MAX_PROBE_BACKOFF = 8


def acceptance_prior(measured: Sequence[float] | None, num_steps: int) -> list[float]:
    """Where the engine-wide acceptance starts: the head's measured accuracy at each depth (a
    depth deeper than measured takes the deepest measured: accuracy falls with depth), kept
    inside (0, 1) so that no depth is written off or taken for granted; ACCEPT_PRIOR without
    a measurement."""
    if not measured:
        return [ACCEPT_PRIOR] * num_steps
    return [min(max(measured[min(d, len(measured) - 1)], 0.01), 0.99) for d in range(num_steps)]


def expected_tokens(alphas: Sequence[float], depth: int) -> list[float]:
    """E[committed tokens] of a k-draft chain for every k in 0..depth, whose depth-d draft is
    accepted with probability alphas[d] given all before it were (the bonus token included).
    One pass for all k: the controller runs this per request every iteration."""
    out, reach = [1.0], 1.0
    for d in range(depth):
        reach *= alphas[d]
        out.append(out[-1] + reach)
    return out


def update_acceptance(alphas: list[float], num_drafts: int, accepted: int) -> None:
    """Folds one verify into `alphas` in place: depths before `accepted` were accepted, the
    depth at `accepted` (when drafted) was rejected, deeper ones were never judged."""
    for d in range(min(accepted + 1, num_drafts)):
        hit = 1.0 if d < accepted else 0.0
        alphas[d] += ACCEPT_EMA * (hit - alphas[d])


@dataclass
class CostTable:
    """Seconds per decode iteration, by batch-size bucket and chain length k: the start-up
    measurement times a per-bucket scale, an EMA of measured iterations over their start-up
    figure. One scale for every k of a bucket, because the controller runs some k rarely: an
    EMA per (bucket, k) would move the k it runs (to what an iteration costs with sampling and
    bookkeeping) and leave the others at their start-up figures, which miss those, so the
    comparison would drift towards the k it does not run."""

    buckets: tuple[int, ...]  # increasing batch sizes; a batch uses the smallest bucket >= bs
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    scale: dict[int, float] = field(default_factory=dict)
    # Per bucket: the head extend that catches up held inputs before drafting resumes.
    catch_up: dict[int, float] = field(default_factory=dict)

    def bucket(self, bs: int) -> int:
        i = bisect.bisect_left(self.buckets, bs)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def cost(self, bs: int, k: int, catching_up: bool = False) -> float:
        """One iteration of depth k; drafting after a stretch without pays the catch-up too."""
        b = self.bucket(bs)
        extra = self.catch_up.get(b, 0.0) if catching_up and k else 0.0
        return self.seconds[(b, k)] * self.scale.get(b, 1.0) + extra

    def observe(self, bs: int, k: int, seconds: float) -> None:
        """Folds one measured iteration (catch-up excluded) into its bucket's scale."""
        b = self.bucket(bs)
        _ema(self.scale, b, seconds / self.seconds[(b, k)])

    def observe_catch_up(self, bs: int, seconds: float) -> None:
        _ema(self.catch_up, self.bucket(bs), seconds)


def _ema(table: dict, key: object, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else old + COST_EMA * (value - old)


def choose_num_drafts(
    alphas_per_req: Sequence[Sequence[float]],
    costs: CostTable,
    choices: Sequence[int],
    catching_up: bool = False,
) -> int:
    """The draft depth k among `choices` (increasing; 0 = no drafts) with the most expected
    committed tokens per second for this batch, where k > 0 must beat k = 0 by DRAFT_MARGIN;
    ties go to the shorter one. `catching_up`: some request holds head inputs, so drafting
    now also pays their catch-up (which makes a stretch without drafts end only when drafting
    clearly pays)."""
    bs = len(alphas_per_req)
    per_req = (expected_tokens(a, choices[-1]) for a in alphas_per_req)
    tokens_by_k = [sum(col) for col in zip(*per_req)]
    best_k, best_rate = 0, -1.0
    for k in choices:
        rate = tokens_by_k[k] / costs.cost(bs, k, catching_up)
        if k == 0:
            rate *= 1 + DRAFT_MARGIN
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


def depth_choices(num_steps: int, is_chain: bool) -> tuple[int, ...]:
    """A chain may stop at any depth; a tree is drafted whole or not at all."""
    return tuple(range(num_steps + 1)) if is_chain else (0, num_steps)


def iterations_between_probes(costs: CostTable, bs: int, probe_k: int, shortest: int) -> int:
    """At least `shortest`, and enough plain decodes that a probe's extra cost (a depth-probe_k
    iteration with a catch-up, less a plain decode) is at most PROBE_SHARE of their time."""
    decode = costs.cost(bs, 0)
    extra = costs.cost(bs, probe_k, catching_up=True) - decode
    return max(shortest, math.ceil(extra / (PROBE_SHARE * decode)))


@dataclass
class AdaptiveController:
    """Picks k per iteration; probes with the shallowest draft after a stretch without drafts
    (see module)."""

    costs: CostTable
    choices: tuple[int, ...]
    probe_interval: int
    since_draft: int = 0  # iterations since the last one that drafted
    backoff: int = 1  # the stretch between probes is this many times the base one

    def choose(self, alphas_per_req: Sequence[Sequence[float]], catching_up: bool = False) -> int:
        self.since_draft += 1
        bs, probe_k = len(alphas_per_req), self.choices[1]
        every = iterations_between_probes(self.costs, bs, probe_k, self.probe_interval)
        if self.since_draft >= every * self.backoff:
            self.since_draft = 0
            self.backoff = min(2 * self.backoff, MAX_PROBE_BACKOFF)
            return probe_k
        k = choose_num_drafts(alphas_per_req, self.costs, self.choices, catching_up)
        if k:  # drafting pays by itself: acceptance is current, and probes start over
            self.since_draft, self.backoff = 0, 1
        return k
