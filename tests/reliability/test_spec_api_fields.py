"""Penalties, logit_bias, min_tokens and echo + logprobs through the HTTP API of an EAGLE server
(overlap on): greedy text equals target-only decoding with the same fields, many requests at
once; prompt logprobs equal a plain transformers forward of the target."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from rel_fixtures import Server, spec_server_fixture, tiny_dirs_fixture  # noqa: F401 (fixtures)
from transformers import LlamaForCausalLM

from eagleserve import Engine
from eagleserve.sampling_params import SamplingParams

FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "logit_bias")  # fmt: skip


def random_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": [rng.randrange(3, 256) for _ in range(rng.randint(1, 30))],
        "max_tokens": rng.randint(4, 24), "temperature": 0, "ignore_eos": rng.random() < 0.5,
        "presence_penalty": round(rng.uniform(-2, 2), 3),
        "frequency_penalty": round(rng.uniform(-2, 2), 3),
        "repetition_penalty": round(rng.uniform(0.5, 2), 3),
        "logit_bias": {str(rng.randrange(256)): round(rng.uniform(-100, 100), 2)
                       for _ in range(rng.randint(0, 4))},
    }  # fmt: skip
    body["min_tokens"] = rng.randint(0, body["max_tokens"])
    for name in FIELDS:  # some requests without some fields
        if rng.random() < 0.25:
            body.pop(name)
    return body


def engine_params(body: dict[str, Any]) -> SamplingParams:
    p = SamplingParams(max_new_tokens=body["max_tokens"], temperature=0.0,
                       ignore_eos=body["ignore_eos"])  # fmt: skip
    for name in FIELDS:
        if name in body:
            setattr(p, name, body[name])
    p.logit_bias = {int(k): v for k, v in body.get("logit_bias", {}).items()}
    return p


def test_penalized_greedy_over_http_equals_target_only(
    spec_server: Server, tiny_dirs: tuple[str, str]
) -> None:
    rng = random.Random()
    bodies = [random_body(rng) for _ in range(24)]
    with ThreadPoolExecutor(8) as pool:  # concurrent: requests share verify batches
        got = list(pool.map(lambda b: httpx.post(spec_server.url + "/v1/completions", json=b,
                                                 timeout=120), bodies))  # fmt: skip
    engine = Engine(model=tiny_dirs[0], device="cpu", dtype="float32", max_total_tokens=2048,
                    max_running_requests=8)  # fmt: skip
    want = engine.generate([b["prompt"] for b in bodies], [engine_params(b) for b in bodies])
    for body, resp, w in zip(bodies, got, want):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["text"] == w["text"], body
        assert resp.json()["usage"]["completion_tokens"] >= body.get("min_tokens", 0)


def test_prompt_logprobs_over_http_equal_a_plain_forward(
    spec_server: Server, tiny_dirs: tuple[str, str]
) -> None:
    model = LlamaForCausalLM.from_pretrained(tiny_dirs[0]).float().eval()
    rng = random.Random()
    for max_tokens in (0, 5):
        ids = [rng.randrange(3, 256) for _ in range(rng.randint(2, 40))]
        # ignore_eos: an EOS among the greedy tokens would end the echo before max_tokens
        body = {"prompt": ids, "max_tokens": max_tokens, "echo": True, "logprobs": 3,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        resp = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        lp = resp.json()["choices"][0]["logprobs"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        want = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=2e-4)


def test_sglang_server_info_reports_the_accept_length(spec_server: Server) -> None:
    """SGLang's /get_server_info on an EAGLE server: avg_spec_accept_length (tokens per verify
    step, the bonus included: at least 1) is the /metrics gauge; the native /generate's greedy
    text equals /v1/completions'."""
    rng = random.Random()
    ids = [rng.randrange(3, 256) for _ in range(rng.randint(2, 12))]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24,
                                                  "ignore_eos": True}}  # fmt: skip
    native = httpx.post(spec_server.url + "/generate", json=body, timeout=120).json()
    plain = {"prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    cmpl = httpx.post(spec_server.url + "/v1/completions", json=plain, timeout=120).json()
    assert native["text"] == cmpl["choices"][0]["text"]
    info = httpx.get(spec_server.url + "/get_server_info").json()
    assert info["speculative_algorithm"] == "EAGLE"
    gauge = [float(line.rsplit(" ", 1)[1])
             for line in httpx.get(spec_server.url + "/metrics").text.splitlines()
             if line.startswith("eagleserve_spec_accept_length")]  # fmt: skip
    accept = info["internal_states"][0]["avg_spec_accept_length"]
    assert accept >= 1 and accept == pytest.approx(gauge[0])


def test_streamed_token_ids_are_target_only_greedy_ids(
    spec_server: Server, tiny_dirs: tuple[str, str]
) -> None:
    """vLLM's return_token_ids on an EAGLE server with overlap: the answer's ids and the
    stream's chunks' ids joined are target-only's greedy ids (tests/server/
    test_return_token_ids.py sees a verify's several tokens in one chunk, with a trained head)."""
    rng = random.Random()
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 20))] for _ in range(4)]
    engine = Engine(model=tiny_dirs[0], device="cpu", dtype="float32", max_total_tokens=2048)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    want = engine.generate(prompts, params)
    for ids, w in zip(prompts, want):
        body = {"prompt": ids, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        whole = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=120).json()
        assert whole["choices"][0]["token_ids"] == w["token_ids"]
        assert whole["choices"][0]["prompt_token_ids"] == ids
        text = httpx.post(spec_server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=120).text  # fmt: skip
        chunks = [json.loads(x[6:])["choices"][0] for x in text.splitlines()
                  if x.startswith("data: {")]  # fmt: skip
        assert sum((c["token_ids"] for c in chunks), []) == w["token_ids"]
