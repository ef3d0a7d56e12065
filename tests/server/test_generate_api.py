"""SGLang's native /generate (server/generate.py) on the default model: the same tokens as
/v1/completions for the same prompt and settings, SGLang's answer form (text, output_ids,
meta_info with its finish_reason), streams whose events hold the answer so far, batches, and a
400 naming what it cannot honour."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    base_url_fixture,
    http_fixture,
    server_fixture,
    tokenizer_fixture,
)

PROMPTS = ["The capital of France is", "List three colours:", "def add(a, b):"]


def generate(http: httpx.Client, **body: Any) -> Any:
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_generate_equals_completions(http: httpx.Client, tokenizer: Any) -> None:
    prompt = random.choice(PROMPTS)
    n_tokens = random.randint(4, 16)
    got = generate(http, text=prompt, sampling_params={
        "temperature": 0, "max_new_tokens": n_tokens, "ignore_eos": True})  # fmt: skip
    cmpl = {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
    want = http.post("/v1/completions", json=cmpl).json()
    assert got["text"] == want["choices"][0]["text"]
    assert tokenizer.decode(got["output_ids"], skip_special_tokens=True) == got["text"]
    meta = got["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": n_tokens}
    assert meta["completion_tokens"] == len(got["output_ids"]) == n_tokens
    assert meta["prompt_tokens"] == want["usage"]["prompt_tokens"] and meta["e2e_latency"] > 0
    ids = tokenizer.encode(prompt)
    by_ids = generate(http, input_ids=ids, sampling_params={
        "temperature": 0, "max_new_tokens": n_tokens, "ignore_eos": True})  # fmt: skip
    assert by_ids["output_ids"] == got["output_ids"]


def test_stream_events_hold_the_answer_so_far(http: httpx.Client) -> None:
    body = {"text": random.choice(PROMPTS), "sampling_params": {
        "temperature": 0.8, "sampling_seed": random.randrange(1000), "max_new_tokens": 12,
        "ignore_eos": True}}  # fmt: skip
    whole = generate(http, **body)
    resp = http.post("/generate", json={**body, "stream": True})
    lines = [line for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    for before, after in zip(events, events[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["completion_tokens"] == 12


def test_a_batch_answers_each_prompt_and_choice(http: httpx.Client, tokenizer: Any) -> None:
    """Token-id prompts with one sampling_params each; n = 2: the answers prompt by prompt,
    choice j seeded seed + j (the greedy ones equal)."""
    prompts = [tokenizer.encode(p) for p in random.sample(PROMPTS, 2)]
    params = [{"temperature": 0, "max_new_tokens": 5, "ignore_eos": True, "n": 2},
              {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True, "n": 2}]  # fmt: skip
    got = generate(http, input_ids=prompts, sampling_params=params)
    assert [a["meta_info"]["completion_tokens"] for a in got] == [5, 5, 3, 3]
    assert got[0]["output_ids"] == got[1]["output_ids"] and got[2]["text"] == got[3]["text"]
    single = generate(http, input_ids=prompts[1], sampling_params={**params[1], "n": 1})
    assert single["output_ids"] == got[2]["output_ids"]
    resp = http.post("/generate", json={"input_ids": prompts, "sampling_params": params[1],
                                        "stream": True})  # fmt: skip
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    last = {e["index"]: e for e in events}
    assert sorted(last) == [0, 1, 2, 3] and last[3]["output_ids"] == got[3]["output_ids"]


def test_stop_and_constraints_in_sglangs_fields(http: httpx.Client) -> None:
    prompt = "Count: 1, 2, 3, 4, 5,"
    free = generate(http, text=prompt, sampling_params={"temperature": 0, "max_new_tokens": 12})
    stop = free["text"].strip().split()[2]
    for keep in (False, True):
        sampling = {"temperature": 0, "max_new_tokens": 12, "stop": [stop], "no_stop_trim": keep}
        got = generate(http, text=prompt, sampling_params=sampling)
        head = free["text"][: free["text"].index(stop)]
        assert got["text"] == head + stop * keep
        assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    got = generate(http, text="A JSON object:", sampling_params={
        "temperature": 0, "max_new_tokens": 24, "json_schema": json.dumps(schema)})  # fmt: skip
    jsonschema.validate(json.loads(got["text"]), schema)


@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_in_sglangs_form_equal_openais(http: httpx.Client, tokenizer: Any, k: int) -> None:
    """return_logprob: output_token_logprobs are [logprob, id, text] of the generated tokens,
    input_token_logprobs the prompt's from logprob_start_len, with k alternatives each; the
    numbers are /v1/completions' (echo and logprobs, tokens named by id)."""
    prompt = random.choice(PROMPTS)
    ids = tokenizer.encode(prompt)
    start = random.randrange(len(ids))
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    got = generate(http, text=prompt, sampling_params=sampling, return_logprob=True,
                   logprob_start_len=start, top_logprobs_num=k,
                   return_text_in_logprobs=True)["meta_info"]  # fmt: skip
    cmpl = http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True,
        "logprobs": max(k, 1), "return_tokens_as_token_ids": True}).json()  # fmt: skip
    lp = cmpl["choices"][0]["logprobs"]
    want_ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    entries = got["input_token_logprobs"] + got["output_token_logprobs"]
    assert [t for _, t, _ in entries] == want_ids[start:]
    assert [v for v, _, _ in entries][start == 0 :] == pytest.approx(
        lp["token_logprobs"][max(start, 1) :], abs=1e-5)  # fmt: skip
    assert all(text == tokenizer.decode([t]) for _, t, text in entries)
    if k == 0:
        assert "output_top_logprobs" not in got
        return
    tops = got["input_top_logprobs"] + got["output_top_logprobs"]
    for top, want in zip(tops, lp["top_logprobs"][start:], strict=True):
        if want is None:
            assert top is None
            continue
        assert {f"token_id:{t}": v for v, t, _ in top} == pytest.approx(
            dict(list(want.items())[:k]), abs=1e-5)  # fmt: skip
    plain = generate(http, text=prompt, sampling_params=sampling, return_logprob=True)
    assert plain["meta_info"]["input_token_logprobs"] == []
    assert all(text is None for _, _, text in plain["meta_info"]["output_token_logprobs"])


@pytest.mark.parametrize(
    ("body", "param", "unsupported"),
    [
        ({"text": "x", "sampling_params": {"max_new_token": 4}},
         "sampling_params.max_new_token", False),
        ({"text": "x", "token_ids_logprob": [5]}, "token_ids_logprob", True),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num", False),
        ({"text": "x", "image_data": "a.png"}, "image_data", True),
        ({"text": "x", "sampling_params": {"structural_tag": "{}"}},
         "sampling_params.structural_tag", False),
        ({"text": "x", "sampling_params": {"custom_params": {"k": 1}}},
         "sampling_params.custom_params", True),
        ({"text": "x", "input_ids": [1]}, "text", False),
        ({"text": ["x", "y"], "sampling_params": [{}]}, "sampling_params", False),
        ({"text": "x", "sampling_params": {"max_new_tokens": 10**7}},
         "sampling_params.max_new_tokens", False),
        ({"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
         "sampling_params.ebnf", False),
        ({"input_ids": [10**9]}, "input_ids", False),
    ],
)  # fmt: skip
def test_what_it_cannot_honour_is_a_400_naming_it(
    http: httpx.Client, body: dict[str, Any], param: str, unsupported: bool
) -> None:
    resp = http.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert (err["code"] == "unsupported_parameter") == unsupported, err


def test_sglangs_info_routes(http: httpx.Client) -> None:
    """/get_server_info: the flags by SGLang's names (no API key) and, under speculation, the
    mean tokens per verify step as SGLang's benchmarks read it; /get_model_info: the model."""
    generate(http, text=random.choice(PROMPTS), sampling_params={"max_new_tokens": 8})
    for path in ("/get_server_info", "/server_info"):
        info = http.get(path).json()
        assert "api_key" not in info and info["max_total_num_tokens"] > 0
        assert info["context_length"] > 0 and "speculative_eagle_topk" in info
        state = info["internal_states"][0]
        if info["speculative_algorithm"]:
            metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                       for line in http.get("/metrics").text.splitlines()
                       if line.startswith("eagleserve_spec_accept_length")}  # fmt: skip
            got = state["avg_spec_accept_length"]
            assert got >= 1 and got == pytest.approx(metrics["eagleserve_spec_accept_length"])
        else:
            assert "avg_spec_accept_length" not in state
    for path in ("/get_model_info", "/model_info"):
        model = http.get(path).json()
        assert model["is_generation"] and model["model_path"]
        ids = http.post("/tokenize", json={"prompt": random.choice(PROMPTS)}).json()["tokens"]
        assert model["vocab_size"] > max(ids)


LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}


def test_abort_request_ends_a_generation_by_its_rid(http: httpx.Client) -> None:
    """A streamed /generate sent with a rid, aborted after its first events: it ends at once
    with finish_reason abort and what it made so far; the rid is free again after, and a rid in
    flight is a 400."""
    rid = f"abort-me-{random.randrange(10**9)}"
    body = {"text": random.choice(PROMPTS), "rid": rid, "stream": True, "sampling_params": LONG}
    events: list[dict[str, Any]] = []
    with http.stream("POST", "/generate", json=body) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 2:
                again = http.post("/generate", json={**body, "stream": False})
                assert again.status_code == 400 and again.json()["error"]["param"] == "rid"
                assert http.post("/abort_request", json={"rid": rid}).json() == {"aborted": 1}
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["id"] == rid
    assert 0 < last["meta_info"]["completion_tokens"] < 1500
    assert len(last["output_ids"]) == last["meta_info"]["completion_tokens"]
    assert http.post("/abort_request", json={"rid": rid}).json() == {"aborted": 0}
    short = generate(http, text="Hi", rid=rid, sampling_params={"max_new_tokens": 2})
    assert short["meta_info"]["id"] == rid


def test_abort_all_ends_every_request(http: httpx.Client, base_url: str) -> None:
    """abort_all: two long requests (one with n = 2) end with what they made, as abort."""
    bodies = [{"text": p, "sampling_params": {**LONG, "n": n}} for p, n in zip(PROMPTS, (1, 2))]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(httpx.post, base_url.removesuffix("/v1") + "/generate", json=b,
                               timeout=120) for b in bodies]  # fmt: skip
        deadline = time.monotonic() + 60
        while http.get("/get_server_info").json()["internal_states"][0]["num_running_reqs"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.post("/abort_request", json={"abort_all": True}).json() == {"aborted": 3}
        answers = [f.result().json() for f in futures]
    flat = [answers[0], *answers[1]]
    assert all(a["meta_info"]["finish_reason"]["type"] == "abort" for a in flat)
    assert all(a["meta_info"]["completion_tokens"] < 1500 for a in flat)
