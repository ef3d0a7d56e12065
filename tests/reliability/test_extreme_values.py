"""Nothing a client sends can raise inside the engine (issue #20 item 1, generalised): every
numeric field of both endpoints, at extreme values, gets a 200 or a 4xx with an OpenAI error
body, never a 5xx, and the server (engine included) keeps serving exactly afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from rel_fixtures import (  # noqa: F401 (fixtures)
    Server,
    completion,
    spec_server_fixture,
    tiny_dirs_fixture,
    wait_kv_free,
)

EXTREMES: list[Any] = [0, -1, 1, 2, 2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63), 1e308,
                       -1e308, 5e-324, 1e-6, 0.5, 3.4e38]  # fmt: skip
# Fields and where they go; each is sent alone on top of a small valid request.
COMMON = ["temperature", "top_p", "top_k", "min_p", "seed", "n", "max_tokens",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"]  # fmt: skip
CMPL_ONLY = ["logprobs", "best_of"]
CHAT_ONLY = ["max_completion_tokens", "top_logprobs"]
BASE_CMPL = {"prompt": [5, 6, 7], "max_tokens": 3}
BASE_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def cases() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for field in COMMON + CMPL_ONLY:
        out += [("/v1/completions", {**BASE_CMPL, field: v}) for v in EXTREMES]
    for field in COMMON + CHAT_ONLY:
        out += [("/v1/chat/completions", {**BASE_CHAT, field: v}) for v in EXTREMES]
    for v in EXTREMES:  # inside lists and maps, and with sampling on (seed + n derivation)
        out.append(("/v1/completions", {**BASE_CMPL, "stop_token_ids": [v]}))
        out.append(("/v1/completions", {**BASE_CMPL, "prompt": [5, v]}))
        out.append(("/v1/completions", {**BASE_CMPL, "logit_bias": {"5": v}}))
        out.append(("/v1/completions", {**BASE_CMPL, "seed": v, "n": 2, "temperature": 1.0}))
        out.append(("/v1/chat/completions", {**BASE_CHAT, "temperature": v, "top_p": 0.5,
                                             "min_p": 0.1, "top_k": 3, "logprobs": True,
                                             "top_logprobs": 2}))  # fmt: skip
        # Penalties and bias reach the sampler (greedy and sampled, chat too); prompt logprobs.
        key = str(int(v)) if isinstance(v, int) else repr(v)
        out.append(("/v1/completions", {**BASE_CMPL, "logit_bias": {key: 50}}))
        out.append(("/v1/completions", {**BASE_CMPL, "temperature": 1.0, "seed": 3,
                                        "repetition_penalty": v, "presence_penalty": 2,
                                        "frequency_penalty": -2, "min_tokens": 2,
                                        "logit_bias": {"5": -100, "6": 100}}))  # fmt: skip
        out.append(("/v1/chat/completions", {**BASE_CHAT, "repetition_penalty": v,
                                             "frequency_penalty": 2, "min_tokens": 3,
                                             "logit_bias": {"7": v}}))  # fmt: skip
        out.append(("/v1/completions", {**BASE_CMPL, "echo": True, "logprobs": v}))
        out.append(("/v1/completions", {**BASE_CMPL, "echo": True, "logprobs": 2,
                                        "max_tokens": v}))  # fmt: skip
        out.append(("/v1/completions", {**BASE_CMPL, "echo": True, "max_tokens": 0,
                                        "logprobs": 5, "min_tokens": v}))  # fmt: skip
    # min_tokens with every token a stop token: nothing would be left to sample.
    out.append(("/v1/completions", {**BASE_CMPL, "min_tokens": 2, "temperature": 1.0,
                                    "stop_token_ids": list(range(256))}))  # fmt: skip
    out.append(("/v1/completions", {**BASE_CMPL, "min_tokens": 3, "temperature": 0,
                                    "stop_token_ids": list(range(256)), "n": 2}))  # fmt: skip
    return out


def test_extreme_numbers_never_5xx_and_the_server_keeps_serving(spec_server: Server) -> None:
    url = spec_server.url
    want = completion(url, [5, 6, 7, 8], 12, ignore_eos=True).json()["choices"][0]["text"]
    failures = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for path, body in cases():
            for stream in (False, True):
                raw = json.dumps({**body, "stream": stream})
                resp = http.post(path, content=raw, headers={"content-type": "application/json"})
                text = resp.text
                if resp.status_code >= 500 or '"server_error"' in text:
                    failures.append((path, raw, resp.status_code, text[:300]))
                elif resp.status_code >= 400:
                    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert failures == [], failures[:5]
        assert http.get("/health").status_code == 200
    again = completion(url, [5, 6, 7, 8], 12, ignore_eos=True).json()["choices"][0]["text"]
    assert again == want
    wait_kv_free(url)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_are_400(spec_server: Server, literal: str) -> None:
    """Python's json writes NaN/Infinity; 1e400 overflows a double. None may reach the engine."""
    for field in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        raw = f'{{"prompt": [5, 6], "max_tokens": 2, "{field}": {literal}}}'
        resp = httpx.post(spec_server.url + "/v1/completions", content=raw,
                          headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
        assert resp.status_code == 400, (field, literal, resp.text)
    assert httpx.get(spec_server.url + "/health").status_code == 200
