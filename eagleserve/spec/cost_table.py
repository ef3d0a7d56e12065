"""What one decode iteration costs, by batch-size bucket and draft depth k: the start-up
measurement (spec/cost_model.py; stored between starts by spec/cost_table_cache.py) refined by
the iterations the adaptive controller (spec/adaptive.py) times as they run."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Weight of the newest measured iteration in a cost EMA; where the scale it refines was last
# measured STALE_AFTER or more iterations earlier (a scale the controller's choices leave
# unmeasured, spec/adaptive.py), STALE_WEIGHT.
COST_EMA = 0.1
STALE_AFTER = 16
STALE_WEIGHT = 0.5
# A bucket's first decode measurements, which correct the start-up table's decode figure: while
# they do, drafting's price does not follow the decode's (see CostTable).
SETTLE_DECODES = 20
# A gap between two decode forwards longer than this many plain decodes is a pause (a garbage
# collection, a grammar compiled), not the host's work of an iteration: not measured.
PAUSE_DECODES = 3.0


@dataclass
class CostTable:
    """Seconds per decode iteration, by batch-size bucket and chain length k: the start-up
    measurement times a per-bucket scale, an EMA of measured iterations over their start-up
    figure. Two scales per bucket, one for plain decodes (k = 0) and one for drafting
    iterations (every k > 0): the start-up parts miss work only a drafting iteration does (the
    acceptance walk, more tokens to commit), and a stored table measured in another process
    can have another ratio of verify to decode; with one scale shared by every k, the k the
    controller runs would set what the others seem to cost. Within drafting, one scale for
    every k: the controller runs some k rarely, and an EMA per (bucket, k) would move the k it
    runs (to what an iteration costs with sampling and bookkeeping) and leave the others at
    their start-up figures, which miss those, so the comparison would drift towards the k it
    does not run. Until a bucket has drafted, its drafting iterations take the decode scale.

    The drafting scale is a ratio over the decode scale: the host's speed moves both alike
    (other tenants, clocks: tens of percent from one minute to the next on a shared CPU), and
    while the controller does not draft, only plain decodes are measured, so a drafting scale
    of its own would keep the price of the minute it was last measured in while the decode's
    follows the host, and drafting that pays again would not be chosen again. Except while a
    bucket's first SETTLE_DECODES decode measurements correct the start-up table's decode
    figure (its own error, not the host's speed): a controller that drafted meanwhile keeps
    drafting's price as measured."""

    buckets: tuple[int, ...]  # increasing batch sizes; a batch uses the smallest bucket >= bs
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    # (bucket, False) -> a decode's measured over start-up seconds; (bucket, True) -> a drafting
    # iteration's, over the decode scale at the time (see class).
    scale: dict[tuple[int, bool], float] = field(default_factory=dict)
    # Per bucket: what the first drafting iteration after a stretch without costs beyond a
    # steady one of its depth: the head extend that catches up held inputs, and the head's
    # weights and KV coming back into caches that plain decodes filled.
    catch_up: dict[int, float] = field(default_factory=dict)
    # Iterations observed so far, and the one at which each scale was last refined.
    clock: int = 0
    scale_at: dict[tuple[int, bool], int] = field(default_factory=dict)
    # False: the drafting scale is its own, not over the decode's (as before; bench/adaptive.py
    # runs such a twin beside the default).
    drafting_follows_decode: bool = True
    decodes_seen: dict[int, int] = field(default_factory=dict)  # per bucket
    # Per bucket, an EMA of the host's time between one decode forward's end and the next
    # one's start: the scheduler's bookkeeping, the outputs sent and, where the server shares
    # the cores, its work on them. Every iteration pays it, whatever its depth, so it weighs
    # for the iterations that commit more tokens (`iteration`).
    between: dict[int, float] = field(default_factory=dict)

    def bucket(self, bs: int) -> int:
        i = bisect.bisect_left(self.buckets, bs)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def cost(self, bs: int, k: int, catching_up: bool = False) -> float:
        """One steady iteration of depth k; with `catching_up`, the first after a stretch
        without drafts, which pays the resume (`catch_up`) too."""
        b = self.bucket(bs)
        decode = self.scale.get((b, False), 1.0)
        if not k:
            return self.seconds[(b, 0)] * decode
        if self.drafting_follows_decode:
            scale = decode * self.scale.get((b, True), 1.0)
        else:
            scale = self.scale.get((b, True), decode)
        return self.seconds[(b, k)] * scale + (self.resume(bs) if catching_up else 0.0)

    def iteration(self, bs: int, k: int) -> float:
        """One steady iteration of depth k from one forward's start to the next one's: `cost`
        and the host's time between forwards."""
        return self.cost(bs, k) + self.between.get(self.bucket(bs), 0.0)

    def observe_between(self, bs: int, seconds: float) -> None:
        """Folds one measured gap between two decode forwards into its bucket's EMA (a pause
        longer than PAUSE_DECODES plain decodes aside)."""
        if 0.0 <= seconds <= PAUSE_DECODES * self.cost(bs, 0):
            _ema(self.between, self.bucket(bs), seconds)

    def resume(self, bs: int) -> float:
        """What the first drafting iteration after a stretch without costs over a steady one."""
        return self.catch_up.get(self.bucket(bs), 0.0)

    def observe(self, bs: int, k: int, seconds: float, resumed: bool = False) -> None:
        """Folds one measured iteration into its bucket's scale for k. One that `resumed`
        drafting (it caught up held inputs first, in `seconds`) is not a steady one: what it
        took beyond a steady iteration of depth k is the resume's cost instead, or the
        drafting scale, learnt from probes alone while the controller does not draft, would
        price every drafting iteration as a resume; where it took less than a steady one is
        priced, it is a steady one's upper bound, and refines the drafting scale."""
        b = self.bucket(bs)
        self.clock += 1
        if resumed and k:
            over = seconds - self.cost(bs, k)
            _ema(self.catch_up, b, max(0.0, over))
            if over >= 0:
                return
            # Cheaper than a steady iteration is priced: the price is too high (a start-up
            # table timed while the host ran slow), and while it keeps the controller from
            # drafting, only probes, which resume, run to show it. A resume costs at least a
            # steady iteration, so it refines the drafting scale as one would, from above.
        key = (b, k > 0)
        # A scale not measured yet starts from its prior (the start-up table as measured, or
        # for drafting the decode scale) and takes its first measurement as a stale one: one
        # slow early iteration (a cold cache, a collection) must not set it outright.
        decode = self.scale.get((b, False), 1.0)
        relative = k > 0 and self.drafting_follows_decode
        prior = decode if k and not relative else 1.0
        old = self.scale.get(key, prior)
        last = self.scale_at.get(key)
        stale = last is None or self.clock - last >= STALE_AFTER
        ratio = seconds / self.seconds[(b, k)] / (decode if relative else 1.0)
        self.scale[key] = old + (STALE_WEIGHT if stale else COST_EMA) * (ratio - old)
        self.scale_at[key] = self.clock
        settling = self.decodes_seen.get(b, 0) < SETTLE_DECODES
        if not k and settling and (b, True) in self.scale and self.drafting_follows_decode:
            # The decode scale is still correcting the start-up table's own error, not following
            # the host: drafting's price, measured meanwhile, stays where it was measured.
            self.scale[(b, True)] *= decode / self.scale[key]
        if not k:
            self.decodes_seen[b] = self.decodes_seen.get(b, 0) + 1


def _ema(table: dict, key: object, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else old + COST_EMA * (value - old)
