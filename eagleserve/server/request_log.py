"""SGLang's `--log-requests`: a log line when a request arrives and one when it finishes
(logger `eagleserve.requests`, INFO), with as much as `--log-requests-level` asks for.

Levels (SGLang's): 0 the metadata (id, route, token counts, finish reason, latency); 1 and the
sampling parameters that differ from the defaults; 2 and the input and output text cut to
`PARTIAL_CHARS` each; 3 and the whole input and output. Texts can hold what users typed: the
levels above 1 are for debugging a deployment, not for its normal logs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from eagleserve.messages import GenerateReqInput
from eagleserve.sampling_params import SamplingParams

REQUEST_LOGGER = "eagleserve.requests"
logger = logging.getLogger(REQUEST_LOGGER)
PARTIAL_CHARS = 2048
_DEFAULTS = SamplingParams()


def cut(text: str, level: int) -> str:
    if level >= 3 or len(text) <= PARTIAL_CHARS:
        return text
    return f"{text[:PARTIAL_CHARS]}...({len(text) - PARTIAL_CHARS} more characters)"


def changed_params(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters that differ from the defaults, as JSON values."""
    out = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if value != getattr(_DEFAULTS, f.name):
            out[f.name] = (
                value if isinstance(value, int | float | str | bool | list) else repr(value)
            )
    return out


def received_line(level: int, endpoint: str, req: GenerateReqInput, tokenizer: Any) -> str:
    fields: dict[str, Any] = {"rid": req.rid, "endpoint": endpoint,
                              "prompt_tokens": len(req.input_ids)}  # fmt: skip
    if req.priority:
        fields["priority"] = req.priority
    if level >= 1:
        fields["sampling_params"] = changed_params(req.sampling_params)
    if level >= 2:
        # At level 2 only the tokens that can make the cut text are decoded (a long prompt's
        # whole decode would hold the event loop).
        head = req.input_ids if level >= 3 else req.input_ids[:PARTIAL_CHARS]
        text = tokenizer.decode(head) if tokenizer is not None else str(head)
        more = len(req.input_ids) - len(head)
        fields["input"] = (
            f"{text[:PARTIAL_CHARS]}...({more} more tokens)" if more else cut(text, level)
        )
    return "Receive: " + json.dumps(fields, ensure_ascii=False)


def finished_line(
    level: int, rid: str, finish_reason: str | None, counts: tuple[int, int, int],
    e2e_s: float, output: str,
) -> str:  # fmt: skip
    prompt, completion, cached = counts
    fields: dict[str, Any] = {"rid": rid, "finish_reason": finish_reason,
                              "prompt_tokens": prompt, "completion_tokens": completion,
                              "cached_tokens": cached, "e2e_latency": round(e2e_s, 4)}  # fmt: skip
    if level >= 2:
        fields["output"] = cut(output, level)
    return "Finish: " + json.dumps(fields, ensure_ascii=False)
