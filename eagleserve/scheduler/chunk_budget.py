"""How many prompt tokens one prefill computes: the chunk of chunked prefill.

Decodes and prefill chunks alternate (`Scheduler.get_next_batch_to_run`), so a stream decoding
beside a long prompt waits, between two of its tokens, one decode iteration plus one chunk.
On a GPU a chunk of `--chunked-prefill-size` tokens costs little next to a decode; on a CPU,
where a forward's cost grows with its rows, a fixed chunk either stalls the streams (a large
one) or slows every prefill (a small one). With `--enable-dynamic-chunking`, on a CPU, while
requests decode, a chunk is cut to the prompt tokens that cost CHUNK_COST_SHARE of a decode
iteration, from the measured times of recent decodes and prefills (forwards there are
synchronous: the host's clock times them); no more than the chunk size, no fewer than
MIN_CHUNK_TOKENS. The streams' gap is then about
1 + CHUNK_COST_SHARE of their usual one, and the long prompt gets that share of the compute
(its time to first token grows accordingly). With --enable-mixed-chunk the chunk runs inside
the decode step's forward, which saves a forward's fixed cost, so the gap comes closer to that
bound and the prompt gets more of the compute. A prefill slower per token than believed shrinks
the next chunk at once; a faster one lets it grow slowly (an EMA), so a misestimate costs one
long gap, not several. With nothing decoding, and on a GPU, the whole chunk size. It is not
the default: prompts arriving together behind a running request are prefilled as slowly, which
costs throughput and time to first token where streams' smoothness matters less.
"""

from __future__ import annotations

from dataclasses import dataclass

# Fewest prompt tokens a chunk computes next to decodes (a prompt must still advance).
MIN_CHUNK_TOKENS = 2
# A chunk next to decodes costs this share of a decode iteration.
CHUNK_COST_SHARE = 0.5
# Weight of the newest measured forward in the EMAs.
TIME_EMA = 0.25


def chunk_tokens(decode_s: float | None, prefill_s_per_token: float | None, max_tokens: int) -> int:
    """The prompt tokens whose prefill costs CHUNK_COST_SHARE of a decode iteration, within
    [MIN_CHUNK_TOKENS, max_tokens]; `max_tokens` before both are measured."""
    if decode_s is None or prefill_s_per_token is None or prefill_s_per_token <= 0:
        return max_tokens
    fits = int(CHUNK_COST_SHARE * decode_s / prefill_s_per_token)
    return max(min(fits, max_tokens), min(MIN_CHUNK_TOKENS, max_tokens))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + TIME_EMA * (new - old)


@dataclass
class ChunkBudget:
    """`max_tokens`: the chunk size (None: chunking off). `dynamic`: cut chunks next to
    decodes from measured times (module docstring)."""

    max_tokens: int | None
    dynamic: bool
    decode_s: float | None = None
    prefill_s_per_token: float | None = None

    def tokens(self, decoding: bool, unchunked_limit: int) -> int:
        """The token budget of the next prefill; `decoding`: requests are running."""
        if self.max_tokens is None:
            return unchunked_limit
        if not (self.dynamic and decoding):
            return self.max_tokens
        return chunk_tokens(self.decode_s, self.prefill_s_per_token, self.max_tokens)

    def observe(self, mode: str, tokens: int, seconds: float, decode_rows: int = 0) -> None:
        """One synchronous forward: a decode iteration, or a prefill of `tokens` rows of which
        the last `decode_rows` were the running requests' decode step (a mixed chunk: the
        prompt tokens cost what the forward took beyond a decode iteration)."""
        if not self.dynamic:
            return
        if mode == "decode":
            self.decode_s = _ema(self.decode_s, seconds)
            return
        if decode_rows and self.decode_s is not None:
            seconds = max(seconds - self.decode_s, 0.0)
        tokens -= decode_rows
        if mode == "extend" and tokens > 0:
            per_token, old = seconds / tokens, self.prefill_s_per_token
            self.prefill_s_per_token = (
                per_token if old is None or per_token > old else _ema(old, per_token)
            )
