"""What the adaptive controller learns of chains that stop short (draft_chain's cut, a CPU's
`--speculative-min-path-prob`), so that it prices a planned depth at what such a chain yields
and costs, not at a whole chain's.

A chain planned k deep drafts j < k tokens where the head's path probability falls below the
cut after j drafts: it then costs and yields a j-chain's. Two things set what a planned depth
is worth, both learnt per batch-size bucket from the chains drafted:
- how far a chain gets (`reach[d - 1]`: the chance that it goes on past depth d once there;
  with more requests in a batch it goes on while any of their paths is likely);
- how often its drafts are accepted where it got that far. The controller's acceptance is per
  depth (P(draft d accepted | the ones before were)), and a product of those predicts a path's
  acceptance over every chain; a chain that got to depth j is one whose drafts the head was
  sure of, and those are accepted much more often than the product says (the first draft
  above all: it is judged over every chain, confident or not). So per depth j >= 2 the
  chains that drafted j give a `lift`: the share of requests that accepted j drafts over the
  share the controller's estimates predicted for them (the ratio of two EMAs).
Without a cut chain seen, reach and lift are 1: a chain priced whole, as before cuts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Weight of the newest chain in each EMA, and how many chains the start (whole chains, no lift)
# is worth: the mean of the chains seen is used until the EMA's window is reached.
CUT_EMA = 0.05
CUT_PRIOR = 2


@dataclass
class ChainCut:
    """One batch-size bucket's chains, `depth` = the deepest a chain is planned."""

    depth: int
    reach: list[float] = field(init=False)  # [depth - 1]
    reach_seen: list[int] = field(init=False)
    # [depth - 1], for depths 2..depth: EMAs of the share of requests that accepted j drafts
    # and of what the controller predicted for them, over chains that drafted j.
    accepted: list[float] = field(init=False)
    predicted: list[float] = field(init=False)
    lift_seen: list[int] = field(init=False)

    def __post_init__(self) -> None:
        n = self.depth - 1
        self.reach, self.reach_seen = [1.0] * n, [0] * n
        self.accepted, self.predicted, self.lift_seen = [1.0] * n, [1.0] * n, [0] * n

    def drafted(self) -> list[float]:
        """P(a chain planned deep enough drafts at least j tokens), j = 1..depth."""
        out, p = [1.0], 1.0
        for r in self.reach:
            p *= r
            out.append(p)
        return out

    def lift(self, predicted: Sequence[float]) -> list[float]:
        """Per depth j = 1..depth: how much more often a chain that drafted j accepts all j
        than the product of acceptance rates says (depth 1: every chain drafts it, 1). A depth
        no chain drafted yet is taken to be accepted as often as the deepest one drafted, over
        `predicted[j - 1]` (the batch's product now): a head sure enough to go on is about as
        often right the step after, and pricing the unknown depth that well is what gets it
        drafted, and so measured."""
        out, through = [1.0], None
        for j, (a, p, seen) in enumerate(
            zip(self.accepted, self.predicted, self.lift_seen, strict=True), 2
        ):
            through = a if seen else through
            if seen:
                out.append(a / p)
            elif through is None:
                out.append(out[-1])
            else:
                out.append(through / max(predicted[j - 1], 1e-6))
        return out

    def observe(
        self, num_drafts: int, goes_on: bool, accepted: Sequence[int], predicted: Sequence[float]
    ) -> None:
        """One chain of `num_drafts` drafts, whose path was still likely after its last draft
        (`goes_on`: it would have gone on, planned deeper); `accepted` [bs] drafts accepted
        per request; `predicted[j - 1]` the batch's mean predicted chance of accepting j
        drafts (products of the acceptance it was planned with)."""
        for d in range(min(num_drafts, self.depth - 1)):  # went on past depth d + 1?
            hit = 1.0 if d + 1 < num_drafts or goes_on else 0.0
            self.reach[d] += _weight(self.reach_seen, d) * (hit - self.reach[d])
        share = [sum(a >= j for a in accepted) / len(accepted) for j in range(num_drafts + 1)]
        for d in range(num_drafts - 1):  # depth j = d + 2 was drafted
            if not self.lift_seen[d]:  # the start: no lift, at this prediction's scale
                self.accepted[d] = self.predicted[d] = predicted[d + 1]
            w = _weight(self.lift_seen, d)
            self.accepted[d] += w * (share[d + 2] - self.accepted[d])
            self.predicted[d] += w * (predicted[d + 1] - self.predicted[d])


def _weight(seen: list[int], d: int) -> float:
    seen[d] += 1
    return max(CUT_EMA, 1.0 / (seen[d] + CUT_PRIOR))


def planned(
    tokens_by_k: Sequence[float], cost_of: Sequence[float], cut: ChainCut
) -> tuple[list[float], list[float]]:
    """Per planned depth k = 0..depth: the batch's expected committed tokens and a chain's
    expected seconds. `tokens_by_k` is `expected_tokens` summed over the batch (whole chains),
    `cost_of[j]` a j-chain's seconds; a chain planned k deep that stops after j drafts costs a
    j-chain's, and each depth's tokens weigh by the chance of getting there and its lift.
    Written as what the whole chain would give less what the cut takes off (nothing, exactly,
    before any chain is seen)."""
    bs = tokens_by_k[0]  # one committed token per request, whatever is drafted
    predicted = [(b - a) / bs for a, b in zip(tokens_by_k, tokens_by_k[1:])]
    drafted, lift = cut.drafted(), cut.lift(predicted)
    tokens, seconds = list(tokens_by_k[:2]), list(cost_of[:2])
    fewer_tokens = fewer_seconds = 0.0
    for j in range(2, len(tokens_by_k)):
        fewer_tokens += (1.0 - drafted[j - 1] * lift[j - 1]) * (tokens_by_k[j] - tokens_by_k[j - 1])
        fewer_seconds += (1.0 - drafted[j - 1]) * (cost_of[j] - cost_of[j - 1])
        tokens.append(tokens_by_k[j] - fewer_tokens)
        seconds.append(cost_of[j] - fewer_seconds)
    return tokens, seconds
