"""Schemathesis against the server's own /openapi.json: no 5xx, no response off its schema.

Bounded: a fixed number of examples per operation, only the public routes. Generation stays
fast because every positive `max_tokens` / `max_completion_tokens` / `max_output_tokens` is
capped (a missing one is set: chat's default is "the rest of the context"; /generate's
sampling_params' max_new_tokens likewise), and `n` too; invalid values stay invalid.
`model` is dropped (a random name would make nearly every case a 404).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rel_fixtures import Server, spec_server_fixture, tiny_dirs_fixture  # noqa: F401 (fixtures)

from eagleserve.server.generate import GENERATE_EXAMPLES
from eagleserve.server.protocol import CHAT_EXAMPLES, COMPLETION_EXAMPLES, TOKENIZE_EXAMPLES
from eagleserve.server.responses_protocol import RESPONSES_EXAMPLES

schemathesis = pytest.importorskip("schemathesis")

OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/responses"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/version"),
              ("POST", "/generate"), ("POST", "/abort_request")]  # fmt: skip
MAX_EXAMPLES = 60
EXAMPLES = {"/v1/completions": COMPLETION_EXAMPLES, "/v1/chat/completions": CHAT_EXAMPLES,
            "/tokenize": TOKENIZE_EXAMPLES, "/generate": GENERATE_EXAMPLES,
            "/v1/responses": RESPONSES_EXAMPLES}  # fmt: skip
CAP = 4


def cap_body(case: Any) -> Any:
    body = case.body
    if isinstance(body, dict):
        body.pop("model", None)  # a random name is a 404 before anything else is looked at
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > CAP:
                body[key] = CAP
        # Unset, a chat's or a response's is the rest of the context (each ignores the other's).
        for key in ("max_tokens", "max_output_tokens"):
            if body.get(key) is None:
                body[key] = CAP
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 2:
            body["n"] = 2
        sampling = body.get("sampling_params")  # /generate's (SGLang's default: 128 tokens)
        for sp in sampling if isinstance(sampling, list) else [sampling]:
            if isinstance(sp, dict):
                v = sp.get("max_new_tokens", CAP + 1)
                if isinstance(v, int) and not isinstance(v, bool) and v > CAP:
                    sp["max_new_tokens"] = CAP
                k = sp.get("n")
                if isinstance(k, int) and not isinstance(k, bool) and k > 2:
                    sp["n"] = 2
    return case


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_schema_fuzz(spec_server: Server, method: str, path: str) -> None:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(spec_server.url + "/openapi.json")
    op = schema[path][method]
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]

    statuses: list[int] = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same examples every run: CI failures reproduce
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a hang would take minutes each
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy().map(cap_body), _=st.just(None))
    def run(case: Any, _: None) -> None:
        try:
            response = case.call(base_url=spec_server.url, timeout=30)
        except Exception as exc:  # a hang or a dropped connection: show the request that did it
            raise AssertionError(
                f"{type(exc).__name__} on {case.method} {case.path} body={case.body!r}"
            ) from exc
        statuses.append(response.status_code)
        case.validate_response(response, checks=checks)

    run()
    # The schema's request examples (penalties, logit_bias, min_tokens, echo + logprobs,
    # max_tokens 0) are served as they are; the generator does not reliably draw them, so
    # they are sent here, and their responses must match the schema too.
    for example in EXAMPLES.get(path, []):
        case = op.Case(body=cap_body(op.Case(body=dict(example))).body)
        response = case.call(base_url=spec_server.url, timeout=30)
        assert response.status_code == 200, (example, response.text)
        case.validate_response(response, checks=checks)
    # Not only rejections: the schema must lead the fuzzer to requests the server accepts.
    assert 200 in statuses, sorted(set(statuses))
    assert method == "GET" or len(statuses) >= 10, len(statuses)  # GETs have no parameters


@pytest.mark.parametrize("echo", [False, True])
def test_out_of_vocab_token_ids_are_400(spec_server: Server, echo: bool) -> None:
    """Found by the fuzzer: with `echo`, out-of-vocabulary ids reached the tokenizer (500)."""
    import httpx

    ctx = httpx.get(spec_server.url + "/v1/models").json()["data"][0]["max_model_len"]
    assert ctx > 8
    for ids in ([87247723, 5], [5, -2034612925926947], [256]):  # the tiny vocab is 256
        body = {"prompt": ids, "max_tokens": 2, "echo": echo}
        resp = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"] == "token ids must be in [0, 256)"
