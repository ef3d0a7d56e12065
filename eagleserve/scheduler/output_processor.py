"""Turning sampled tokens into request state: finish checks, stop strings, outgoing messages."""

from __future__ import annotations

import time

import numpy as np

from eagleserve.core import FinishReason, GenerationBatchResult, Req
from eagleserve.mem_cache.kv_cache import ReqToTokenPool
from eagleserve.messages import TokenOutput
from eagleserve.sampling_params import SamplingParams

TopLogprobs = list[list[tuple[int, float]]]


def eos_token_ids(config_eos: tuple[int, ...], tokenizer: object | None) -> frozenset[int]:
    """The model config's EOS ids and the tokenizer's own."""
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset(config_eos) | ({tokenizer_eos} if tokenizer_eos is not None else set())


def response_text(tokenizer: object, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids` as a response shows it (and the server's detokenizer builds it): no
    special tokens unless asked, no clean-up of spaces (a later token must not change earlier
    text)."""
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def text_ids(
    new_ids: list[int], finished_by: int | str | None, params: SamplingParams
) -> list[int]:
    """Of a request's newest ids, those whose text the response shows: the stop token (EOS or
    a stop id) that ended it only with include_stop_str_in_output, as vLLM shows it."""
    if isinstance(finished_by, int) and not params.include_stop_str_in_output:
        return new_ids[:-1]
    return new_ids


def text_before_stop(tokenizer: object, ids: list[int], params: SamplingParams) -> str:
    """The response text of a request that a stop string ended: cut before (with
    include_stop_str_in_output, after) the first stop string that ends after the text of its
    first min_tokens tokens, as the server cuts it."""
    skip, min_tokens = params.skip_special_tokens, params.min_tokens
    text = response_text(tokenizer, ids, skip)
    head = (
        len(response_text(tokenizer, ids[:min_tokens], skip).rstrip("\ufffd")) if min_tokens else 0
    )
    found = [(i, s) for s in params.stop
             if s and (i := text.find(s, max(0, head - len(s) + 1))) >= 0]  # fmt: skip
    if not found:
        return text
    i, s = min(found, key=lambda f: f[0])
    return text[: i + len(s) if params.include_stop_str_in_output else i]


class StopChecker:
    """EOS, stop ids, max_new_tokens and stop strings; one token at a time so a run of accepted
    speculative tokens is cut exactly where target-only decoding would stop."""

    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer

    def check(self, req: Req) -> None:
        params = req.sampling_params
        last = req.output_ids[-1]
        if len(req.output_ids) <= params.min_tokens:
            # The sampler masks EOS and stop ids below min_tokens; stop strings wait too.
            if len(req.output_ids) >= params.max_new_tokens:
                req.finish_reason = FinishReason.LENGTH
        elif (not params.ignore_eos or params.grammar is not None) and last in req.eos_token_ids:
            # Under a grammar EOS is allowed only once the output is complete: it ends the
            # request even with ignore_eos (past it nothing is grammatical).
            req.finish_reason, req.matched_stop = FinishReason.STOP, last
        elif last in params.stop_token_ids:
            req.finish_reason, req.matched_stop = FinishReason.STOP, last
        elif params.stop and self._matches_stop_string(req):
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish_reason = FinishReason.LENGTH

    def _matches_stop_string(self, req: Req) -> bool:
        assert self.tokenizer is not None, "stop strings need a tokenizer"
        longest = max(len(s) for s in req.sampling_params.stop)
        # Every token decodes to at least one character or is part of one, so this tail covers
        # any stop string ending in the newest token.
        tail_ids = req.output_ids[-(longest + 4) :]
        skip = req.sampling_params.skip_special_tokens  # as the response text shows them
        tail = response_text(self.tokenizer, tail_ids, skip)
        # Only a match that ends in the newest token's text counts: earlier ones were checked
        # before, or fell in the first min_tokens tokens (an occurrence there must not hide a
        # new one). Half a character decodes to U+FFFD until its last byte arrives.
        before = len(response_text(self.tokenizer, tail_ids[:-1], skip).rstrip("\ufffd"))
        for s in req.sampling_params.stop:
            if tail.find(s, max(0, before - len(s) + 1)) >= 0:
                req.matched_stop = s
                return True
        return False


def committed_rows(
    result: GenerationBatchResult,
) -> list[tuple[list[int], list[float] | None, TopLogprobs | None]]:
    """Per batch row, on the host: the tokens it committed (a decode's one, or a verify's
    accepted drafts and bonus token), with their logprobs and top alternatives if computed."""
    ids = result.next_token_ids.tolist()
    accept = None if result.accept_lens is None else result.accept_lens.tolist()
    lps = None if result.logprobs is None else result.logprobs.tolist()
    tvals = None if result.top_logprob_vals is None else result.top_logprob_vals.tolist()
    tids = None if result.top_logprob_ids is None else result.top_logprob_ids.tolist()
    rows = []
    for i in range(len(ids)):
        if accept is None:  # one token per row: the same lists, one position deep
            toks, lp = [ids[i]], None if lps is None else [lps[i]]
            top = None if tids is None else [list(zip(tids[i], tvals[i]))]  # type: ignore[index]
        else:
            n = accept[i]
            toks, lp = ids[i][:n], None if lps is None else lps[i][:n]
            top = None if tids is None else [
                list(zip(tids[i][j], tvals[i][j])) for j in range(n)  # type: ignore[index]
            ]  # fmt: skip
        rows.append((toks, lp, top))
    return rows


def append_tokens(
    req: Req,
    tokens: list[int],
    checker: StopChecker,
    logprobs: list[float] | None = None,
    top: list[list[tuple[int, float]]] | None = None,
) -> int:
    """Appends tokens one by one until the request finishes; returns how many were taken.
    `top` holds the batch's most alternatives per token: the request keeps the number it asked
    for, so its answer does not depend on what else was batched with it."""
    taken = 0
    k = req.sampling_params.logprobs or 0
    for i, tok in enumerate(tokens):
        req.output_ids.append(tok)
        if logprobs is not None:
            req.output_logprobs.append(logprobs[i])
            req.output_top_logprobs.append(top[i][:k] if top is not None else [])
        taken += 1
        checker.check(req)
        if req.finished:
            break
    return taken


# A request that is not streamed still sends its output every this many tokens (SGLang's
# choice), or after this many seconds without one: the server then detokenizes as it goes and
# counts tokens and inter-token latency while the request runs, and /health_generate, which
# takes tokens sent in its last RECENT_TOKENS_S (5 s) while requests run as proof that the
# engine works, sees them come even where a slow decode takes longer than that for 50.
NON_STREAM_INTERVAL = 50
NON_STREAM_MAX_WAIT_S = 1.0


def output_due(req: Req, stream_interval: int, now: float) -> bool:
    """Whether `req`'s unsent tokens go to the server at monotonic time `now`: its first token
    at once (the time to it is the client's first wait and the server's TTFT), then whenever
    `stream_interval` are unsent (where the client waits for the whole answer: every
    NON_STREAM_INTERVAL at least, or NON_STREAM_MAX_WAIT_S after the last), and the rest with
    its end."""
    if req.finished or req.num_sent_tokens == 0:
        return True
    unsent = len(req.output_ids) - req.num_sent_tokens
    if req.stream:
        return unsent >= stream_interval
    waited = now - req.output_sent_time >= NON_STREAM_MAX_WAIT_S
    return unsent >= max(stream_interval, NON_STREAM_INTERVAL) or (unsent > 0 and waited)


def make_output(req: Req) -> TokenOutput:
    new = req.output_ids[req.num_sent_tokens :]
    want_lp = req.sampling_params.logprobs is not None
    out = TokenOutput(
        rid=req.rid,
        new_token_ids=list(new),
        finished=req.finished,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        matched_stop=req.matched_stop,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        logprobs=req.output_logprobs[req.num_sent_tokens :] if want_lp else None,
        top_logprobs=req.output_top_logprobs[req.num_sent_tokens :] if want_lp else None,
        spec_accept_length=(
            req.spec_accepted_tokens / req.spec_verify_ct if req.spec_verify_ct else None
        ),
    )
    if req.prompt_logprobs is not None:
        out.prompt_logprobs = req.prompt_logprobs
        req.prompt_logprobs = None
    start = req.prefill_start_time
    if req.num_sent_tokens == 0 and start is not None and (new or req.finished):
        out.queue_time_s = start - req.arrival_time
        out.prefill_time_s = time.monotonic() - start
    req.num_sent_tokens = len(req.output_ids)
    req.output_sent_time = time.monotonic()
    return out


def commit_tree_paths_host(
    pool: ReqToTokenPool, reqs: list[Req], result: GenerationBatchResult, partial: Req | None
) -> None:
    """A tree verify reordered each row's accepted path on the device (spec/accept.py::
    commit_tree_path); the host's copy of the rows whose requests go on is reordered alike,
    from their committed lengths before this result (where that verify started). Called before
    the result's tokens are appended. The same permutation (a stable sort of each row's nodes
    on "rejected"), in numpy on the host copy's buffer: an op costs a microsecond there and
    several as a torch op, and this runs every tree iteration on the scheduler's thread."""
    live = [i for i, r in enumerate(reqs) if not r.finished and r is not partial]
    if not live:
        return
    assert result.tree_path is not None and result.tree_nodes is not None
    n = result.tree_nodes
    # A synchronous forward hands its result over on the device (the overlap path's to_host
    # copy is already on the host); its tokens were read back by now, so this waits for nothing.
    path = result.tree_path.cpu().numpy()[live]
    host = pool.req_to_token_host.numpy()  # shares the tensor's memory
    rows = np.array([reqs[i].req_pool_idx for i in live])[:, None]
    cols = np.array([reqs[i].kv_committed_len for i in live])[:, None] + np.arange(n)
    each = np.arange(len(live))[:, None]
    rejected = np.ones(cols.shape, dtype=np.uint8)
    rejected[each, path.clip(min=0)] = 0  # a path's -1 padding marks the root, always held
    order = rejected.argsort(axis=1, kind="stable")
    host[rows, cols] = host[rows, cols][each, order]
