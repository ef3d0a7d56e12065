"""vLLM's beam search (`use_beam_search`, `length_penalty`), as vLLM runs it: above the engine,
one step at a time. Each step asks the engine for one token of every live beam with its top
2 * width logprobs (the prefix cache holds the beams' shared prefixes); a beam that reaches EOS
is complete, the `width` best of the rest by cumulative logprob go on. After `max_tokens`
steps, complete and live beams are ranked by cumulative logprob / length ** length_penalty
(length: prompt and generated tokens, EOS not counted, as vLLM and transformers count it), and
the `width` best are the call's choices. Scores use the model's own logprobs, so temperature
and the sampling filters do not enter (as in vLLM).

`BeamSearchStream` hands the choices to the handlers as a `RequestStream` would: one final
`TokenOutput` per choice once the search ends.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.sampling_params import SamplingParams
from eagleserve.server.engine_client import EngineClient, RequestStream

MAX_BEAM_WIDTH = 10  # 2 * width logprobs per step, at most 20


@dataclass
class Beam:
    tokens: list[int]  # prompt and generated
    cum_logprob: float = 0.0
    # Per generated token: its logprob and the step's candidates (id, logprob), best first.
    logprobs: list[float] = field(default_factory=list)
    candidates: list[list[tuple[int, float]]] = field(default_factory=list)
    ended_by_eos: bool = False


def beam_score(beam: Beam, length_penalty: float) -> float:
    n = len(beam.tokens) - (1 if beam.ended_by_eos else 0)
    return beam.cum_logprob / (max(n, 1) ** length_penalty)


def advance_beams(
    beams: list[Beam],
    candidates: list[list[tuple[int, float]]],
    width: int,
    eos: int | None,
) -> tuple[list[Beam], list[Beam]]:
    """One step: beam i extended by each of its `candidates[i]` (token, logprob); returns
    (the `width` best extensions by cumulative logprob that do not end in `eos`, those that
    do). Ties go to the earlier beam and the likelier candidate."""
    grown: list[tuple[float, int, int, Beam]] = []
    completed = []
    for i, (beam, cands) in enumerate(zip(beams, candidates, strict=True)):
        for rank, (token, lp) in enumerate(cands):
            new = Beam(beam.tokens + [token], beam.cum_logprob + lp, beam.logprobs + [lp],
                       beam.candidates + [cands], ended_by_eos=token == eos)  # fmt: skip
            if new.ended_by_eos:
                completed.append(new)
            else:
                grown.append((-new.cum_logprob, i, rank, new))
    grown.sort(key=lambda g: g[:3])
    return [g[3] for g in grown[:width]], completed


def best_beams(beams: list[Beam], width: int, length_penalty: float) -> list[Beam]:
    return sorted(beams, key=lambda b: -beam_score(b, length_penalty))[:width]


@dataclass(frozen=True)
class BeamSettings:
    width: int
    eos: int | None  # None with ignore_eos: no beam completes early
    length_penalty: float
    logprobs: int | None  # alternatives per token in the answer (None: no logprobs)


async def next_candidates(
    client: EngineClient, beams: list[Beam], k: int, running: list[RequestStream]
) -> list[list[tuple[int, float]]] | TokenOutput:
    """The top-k next tokens of each beam, or the error output that ended the step."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True)
    reqs = [GenerateReqInput(f"beam-{uuid.uuid4().hex}", b.tokens, params) for b in beams]
    stream = client.generate(reqs)
    running.append(stream)
    got: dict[str, list[tuple[int, float]]] = {}
    try:
        async for out in stream:
            if out.error is not None or out.finish_reason == "abort":
                return out
            if out.top_logprobs:
                got[out.rid] = out.top_logprobs[0]
    finally:
        stream.close()
        running.remove(stream)
    return [got[r.rid] for r in reqs]


async def search(
    client: EngineClient,
    prompt: list[int],
    max_tokens: int,
    s: BeamSettings,
    running: list[RequestStream],
) -> list[Beam] | TokenOutput:
    beams, completed = [Beam(list(prompt))], []
    for _ in range(max_tokens):
        cands = await next_candidates(client, beams, 2 * s.width, running)
        if isinstance(cands, TokenOutput):
            return cands
        beams, done = advance_beams(beams, cands, s.width, s.eos)
        completed += done
        if not beams:
            break
    return best_beams(completed + beams, s.width, s.length_penalty)


def choice_output(rid: str, beam: Beam, prompt_len: int, s: BeamSettings) -> TokenOutput:
    generated = beam.tokens[prompt_len:]
    top = None if s.logprobs is None else [c[: s.logprobs] for c in beam.candidates]
    return TokenOutput(
        rid, generated, True, "stop" if beam.ended_by_eos else "length",
        matched_stop=s.eos if beam.ended_by_eos else None, prompt_tokens=prompt_len,
        completion_tokens=len(generated),
        logprobs=None if s.logprobs is None else list(beam.logprobs), top_logprobs=top,
    )  # fmt: skip


class BeamSearchStream:
    """A call's beam searches (one per prompt, to its max_new_tokens; its `width` choices are
    requests prompt * width + j of `reqs`, never sent themselves), iterated as a RequestStream:
    each choice's one output."""

    def __init__(
        self, client: EngineClient, reqs: list[GenerateReqInput], settings: BeamSettings
    ) -> None:
        self.client = client
        self.reqs = reqs
        self.settings = settings
        self.closed = False
        self.running: list[RequestStream] = []  # the step streams in flight
        self.outputs: list[TokenOutput] | None = None

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> TokenOutput:
        if self.outputs is None:
            self.outputs = await self._run()
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    async def _run(self) -> list[TokenOutput]:
        s, w = self.settings, self.settings.width
        firsts = self.reqs[::w]
        results = await asyncio.gather(*(
            search(self.client, r.input_ids, r.sampling_params.max_new_tokens, s, self.running)
            for r in firsts
        ))  # fmt: skip
        outputs = []
        for p, (first, result) in enumerate(zip(firsts, results, strict=True)):
            prompt_len = len(first.input_ids)
            for j, req in enumerate(self.reqs[p * w : (p + 1) * w]):
                if isinstance(result, TokenOutput):  # an engine error, an abort, the shutdown
                    code = result.error_code
                    outputs.append(TokenOutput(req.rid, [], True, result.finish_reason,
                                               error=result.error, error_code=code))  # fmt: skip
                elif j < len(result):
                    outputs.append(choice_output(req.rid, result[j], prompt_len, s))
                else:  # fewer beams than the width (a tiny vocabulary)
                    outputs.append(
                        TokenOutput(req.rid, [], True, "length", prompt_tokens=prompt_len)
                    )
        return outputs

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in list(self.running):
            stream.close()
