"""Adaptive speculation: per decode iteration, the draft depth k that maximises expected committed
tokens per second, from live acceptance and measured cost: a chain stops at any k in 0..num_steps,
a tree is drafted whole (k = num_steps) or not at all (k = 0, a plain decode).

- Acceptance, per request and depth d: `alphas[d]` = P(draft at depth d+1 accepted | drafts
  before it were), estimated from the request's own verifies shrunk towards the engine-wide
  rate (`request_acceptance`): PRIOR_TRIALS pseudo-trials at the engine-wide rate plus its
  verified drafts there, each weighing EVIDENCE_DECAY per iteration since. A request's own
  rate can differ from the engine's (code is easier to draft than chat), but a handful of
  its verifies are mostly noise; and a request that stops drafting stops being judged, so
  its stale low estimate must fade back to the engine's, or one unlucky run would end its
  drafting for good. The engine-wide rate is an EMA over every verify (ENGINE_ACCEPT_EMA)
  that starts from the head's own held-out accuracy by depth where its training log has it
  (`acceptance_prior`): deep depths are judged only after every shallower draft was
  accepted, so their rates move rarely and a made-up start would steer the controller for a
  long time. The start weighs PRIOR_VERIFIES verifies (live text is not the held-out set:
  the rate is their mean until the EMA's window is reached). It must move slowly: it is
  where every new request starts, and when a short run of rejections carries it below what
  drafting needs, new requests stop drafting and only the rare probe (below) judges it again.
- Expected committed tokens of one request with a k-chain (the bonus token always counts):
  E[k] = 1 + sum_{j=1..k} prod_{d<j} alphas[d]  (`expected_tokens`, every k at once); for a
  tree the same sum over its per-depth acceptance (the accepted path is a chain through the tree).
- Cost: `CostTable` (spec/cost_table.py) holds the seconds of one decode iteration per
  batch-size bucket and k, measured at start-up and scaled per bucket by EMAs of measured
  iterations, one for plain decodes and one for drafting iterations.
- Every iteration also pays the host's time between two forwards (the scheduler's bookkeeping,
  the outputs sent, and where the server shares the cores, its work on them), whatever its k:
  `CostTable.iteration`, from the gaps measured between decode forwards (`note_forward`; a
  prefill in between is no such gap). Without it, a plain decode looked cheaper next to a
  drafting iteration than it is, most where that work is largest (served on a small CPU host).
- `choose_num_drafts`: argmax_k sum_r E_r[k] / iteration(bs, k); k = 0 is a plain target decode,
  and a draft must beat it by DRAFT_MARGIN: acceptance is an estimate (the head's held-out
  accuracy runs above what it achieves on live text, and deep depths are rarely judged), so
  a draft predicted to pay by less is as likely to lose, and losing is what speculation must
  not do. A plain decode given up for a draft that pays by less costs at most that margin.

Iterations that do not draft judge no draft, so after a stretch without drafts one iteration
drafts regardless, at the shallowest depth (the price of noticing that acceptance went up; once
the first depth pays, the controller goes deeper by itself where the deeper rates say so). The
stretch is `probe_interval` iterations, or longer where a probe costs more than PROBE_SHARE of
the decodes between probes (`iterations_between_probes`): a probe drafts for the whole batch
and catches up every request's held head inputs, which grows with the batch. Each probe after
which the controller still does not draft by itself doubles the stretch, up to
MAX_PROBE_BACKOFF times: where drafting keeps not paying, probing less is what is left to gain.

The other way round, iterations that draft measure no plain decode, and the plain decodes'
cost scale is what drafting is weighed against: if the first plain decodes were slow (a cold
start) or the machine has sped up since, a plain decode keeps looking dearer than it is and
drafting that does not pay goes on for good. So a controller that drafts by choice, and whose
iterations are timed (a CPU's), decodes plainly once every stretch (a plain probe; at most the
resume of one held input, and one iteration's share of what drafting gains), and a cost scale
not measured for a while, or not yet measured at all, takes its next measurement at more
weight (spec/cost_table.py, STALE_AFTER).

Only steady iterations are measured: the first WARM_DECODES decode iterations after a prefill
are not. After a prefill, or the idle time before a new request's, the decodes slow down by
tens of percent, fading over about ten iterations, as memory streams slowly at first (on a
CPU; a plain pass over as many bytes slows alike); drafting iterations, rarer and mostly
later in a stretch, are seldom among them, so measuring those decodes priced a plain decode
above what it costs once warm, against a drafting iteration measured warm, and drafting that
did not pay looked as if it did. Both kinds slow down alike while cold, so the choice made
from warm prices holds then too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from eagleserve.spec.chain_cut import ChainCut, planned
from eagleserve.spec.cost_table import CostTable

# Weight of the newest verify in the engine-wide acceptance EMA (see module), and how many
# verifies its start, the head's held-out accuracy, is worth.
ENGINE_ACCEPT_EMA = 0.01
PRIOR_VERIFIES = 10
# A request's acceptance: its verified drafts at a depth plus this many at the engine's rate...
PRIOR_TRIALS = 8.0
# ...its own weighing this factor less with every iteration since (k = 0 ones too).
EVIDENCE_DECAY = 0.9
# Acceptance assumed at every depth before the engine has verified anything.
ACCEPT_PRIOR = 0.5
# Iterations a resumed drafting run is expected to last (a request's acceptance moves slowly):
# deciding to resume, the controller spreads the resume's cost over them.
RESUME_HORIZON = 4
# Decode iterations after a prefill whose times are not measured (see module).
WARM_DECODES = 12
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


def update_acceptance(
    alphas: list[float], judged: list[int], num_drafts: int, accepted: int
) -> None:
    """Folds one verify into the engine-wide `alphas` in place: depths before `accepted` were
    accepted, the depth at `accepted` (when drafted) was rejected, deeper ones were never
    judged. `judged[d]` counts depth d's verifies so far: the start (the head's held-out
    accuracy) weighs PRIOR_VERIFIES of them, the live rate their mean until the EMA's window
    is reached, then its EMA."""
    for d in range(min(accepted + 1, num_drafts)):
        hit = 1.0 if d < accepted else 0.0
        judged[d] += 1
        weight = max(ENGINE_ACCEPT_EMA, 1.0 / (judged[d] + PRIOR_VERIFIES))
        alphas[d] += weight * (hit - alphas[d])


def record_verify(hits: list[float], trials: list[float], num_drafts: int, accepted: int) -> None:
    """Adds one verify to a request's evidence in place (judged depths as in
    `update_acceptance`)."""
    for d in range(min(accepted + 1, num_drafts)):
        hits[d] += 1.0 if d < accepted else 0.0
        trials[d] += 1.0


def request_acceptance(
    hits: list[float], trials: list[float], engine: Sequence[float]
) -> list[float]:
    """A request's acceptance by depth from its evidence, which this first ages by one
    iteration in place (called once per decode iteration the request takes part in)."""
    out = []
    for d, rate in enumerate(engine):
        hits[d] *= EVIDENCE_DECAY
        trials[d] *= EVIDENCE_DECAY
        out.append((PRIOR_TRIALS * rate + hits[d]) / (PRIOR_TRIALS + trials[d]))
    return out


def choose_num_drafts(
    alphas_per_req: Sequence[Sequence[float]],
    costs: CostTable,
    choices: Sequence[int],
    catching_up: bool = False,
    cut: ChainCut | None = None,
) -> int:
    """The draft depth k among `choices` (increasing; 0 = no drafts) with the most expected
    committed tokens per second for this batch, where k > 0 must beat k = 0 by DRAFT_MARGIN;
    ties go to the shorter one. `catching_up`: some request holds head inputs, so drafting
    now also pays the resume, spread over RESUME_HORIZON iterations (which makes a stretch
    without drafts end only when drafting clearly pays). `cut`: chains stop short where the
    head is unsure (spec/chain_cut.py), so a planned depth yields and costs what those do."""
    bs = len(alphas_per_req)
    tokens_by_k = batch_tokens(alphas_per_req, choices[-1])
    if cut is None:
        seconds_by_k = {k: costs.iteration(bs, k) for k in choices}
    else:  # a chain: every depth 0..choices[-1] is a choice, and has a cost
        whole = [costs.iteration(bs, k) for k in range(choices[-1] + 1)]
        tokens_by_k, expected_seconds = planned(tokens_by_k, whole, cut)
        seconds_by_k = dict(enumerate(expected_seconds))
    resume = costs.resume(bs) if catching_up else 0.0
    best_k, best_rate = 0, -1.0
    for k in choices:
        tokens, seconds = tokens_by_k[k], seconds_by_k[k]
        rate = tokens / (seconds + (resume / RESUME_HORIZON if k else 0.0))
        if k == 0:
            rate *= 1 + DRAFT_MARGIN
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


def batch_tokens(alphas_per_req: Sequence[Sequence[float]], depth: int) -> list[float]:
    """`expected_tokens` summed over the batch, for every k in 0..depth."""
    per_req = (expected_tokens(a, depth) for a in alphas_per_req)
    return [sum(col) for col in zip(*per_req)]


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
    since_plain: int = 0  # iterations since the last plain decode
    # Whether the iterations' times refine `costs` (a CPU's, timed as they run): only then does
    # a plain probe measure anything.
    plain_probes: bool = True
    decodes_since_prefill: int = 0
    # Per batch-size bucket, its chains cut short (`observe_chain`); none: chains priced whole.
    cuts: dict[int, ChainCut] = field(default_factory=dict)
    # The acceptance the last choice was made with (per request, by depth).
    last_alphas: Sequence[Sequence[float]] = ()
    # When the last decode forward ended (perf_counter seconds); None after a prefill.
    last_forward_end: float | None = None

    def note_prefill(self) -> None:
        """A prefill ran: the decodes after it are not measured until warm (see module), and
        the gap before the next decode holds the prefill."""
        self.decodes_since_prefill = 0
        self.last_forward_end = None

    def note_forward(self, bs: int, start: float, end: float) -> None:
        """A timed decode forward ran from `start` to `end` (perf_counter seconds): the time
        since the previous one ended is the host's between them (`CostTable.observe_between`)."""
        if self.last_forward_end is not None:
            self.costs.observe_between(bs, start - self.last_forward_end)
        self.last_forward_end = end

    def observe(self, bs: int, k: int, seconds: float, resumed: bool = False) -> None:
        """One timed decode iteration (`CostTable.observe`), unless it is one of the first
        WARM_DECODES after a prefill."""
        self.decodes_since_prefill += 1
        if self.decodes_since_prefill > WARM_DECODES:
            self.costs.observe(bs, k, seconds, resumed)

    def observe_chain(
        self, bs: int, num_drafts: int, goes_on: bool, accepted: Sequence[int]
    ) -> None:
        """A chain that may stop short drafted `num_drafts` tokens (`ChainCut.observe`), with
        the batch's mean chance of accepting j drafts that the latest choice was made with
        (with overlap, one iteration newer: estimates move slowly)."""
        b, depth = self.costs.bucket(bs), self.choices[-1]
        cut = self.cuts.setdefault(b, ChainCut(depth))
        reqs = self.last_alphas or [[1.0] * depth]
        tokens = batch_tokens(reqs, depth)
        predicted = [(y - x) / len(reqs) for x, y in zip(tokens, tokens[1:])]
        cut.observe(num_drafts, goes_on, accepted, predicted)

    def choose(self, alphas_per_req: Sequence[Sequence[float]], catching_up: bool = False) -> int:
        self.since_draft += 1
        bs, probe_k = len(alphas_per_req), self.choices[1]
        self.last_alphas = alphas_per_req
        every = iterations_between_probes(self.costs, bs, probe_k, self.probe_interval)
        if self.since_draft >= every * self.backoff:
            self.since_draft = 0
            self.backoff = min(2 * self.backoff, MAX_PROBE_BACKOFF)
            return probe_k
        cut = self.cuts.get(self.costs.bucket(bs))
        k = choose_num_drafts(alphas_per_req, self.costs, self.choices, catching_up, cut)
        if not k:
            self.since_plain = 0
            return 0
        # Drafting pays by itself: acceptance is current, and probes start over; the plain
        # decode it is weighed against is measured once a stretch (see module).
        self.since_draft, self.backoff = 0, 1
        self.since_plain += 1
        if self.plain_probes and self.since_plain > every:
            self.since_plain = 0
            return 0
        return k
