"""The server under bad input, client disconnects, API keys; and its /metrics."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import (  # noqa: F401 (fixtures)
    API_KEY,
    MODEL,
    ServerProcess,
    base_url_fixture,
    http_fixture,
    key_server_fixture,
    metric,
    server_fixture,
    wait_kv_free,
)

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}

BAD_REQUESTS: list[tuple[str, Any, int]] = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": {"a": 1}}, 400),
    ("/v1/completions", {"max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": "hello " * 5000, "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4096}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": True, "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99}, 400),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
     404),
    ("/v1/no-such-route", {}, 404),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "code"), BAD_REQUESTS)
def test_bad_input_is_4xx_and_server_stays_up(
    http: httpx.Client, path: str, body: Any, code: int
) -> None:
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code == code, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    ok = http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_openai_client_raises_typed_errors(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert "max_tokens" in str(exc.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_stream_disconnect_frees_kv(server: ServerProcess, http: httpx.Client) -> None:
    others: list[httpx.Response] = []

    def normal() -> None:
        others.append(http.post("/v1/completions", json={**GOOD, "max_tokens": 12}))

    threads = [threading.Thread(target=normal) for _ in range(2)]
    with httpx.Client(base_url=server.url, timeout=120) as c:
        body = {"model": MODEL, "prompt": "Count:", "stream": True, **LONG}
        with c.stream("POST", "/v1/completions", json=body) as resp:
            for t in threads:
                t.start()
            got = 0
            for line in resp.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break
    for t in threads:
        t.join()
    assert [r.status_code for r in others] == [200, 200]
    wait_kv_free(http, timeout=30)  # 3000 tokens would take minutes: it was aborted


def test_non_stream_disconnect_frees_kv(server: ServerProcess, http: httpx.Client) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "Count:", **LONG}, timeout=2)
    wait_kv_free(http, timeout=30)


def test_api_key(key_server: ServerProcess) -> None:
    url = key_server.url
    body = {"prompt": "Hi", "max_tokens": 2}
    assert httpx.get(url + "/health").status_code == 200  # open without a key
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    bad = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer no"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models/default").status_code == 401
    for route, tok_body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5]})):
        assert httpx.post(url + route, json=tok_body).status_code == 401
        keyed = httpx.post(
            url + route, json=tok_body, headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert keyed.status_code == 200
    assert httpx.post(url + "/flush_cache").status_code == 401
    assert httpx.get(url + "/version").status_code == 200  # open, as /health
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model="default", prompt="Hi", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics_parse_and_move(http: httpx.Client) -> None:
    names = {f.name for f in text_string_to_metric_families(http.get("/metrics").text)}
    for want in ("eagleserve_requests", "eagleserve_prompt_tokens", "eagleserve_kv_used_tokens",
                 "eagleserve_time_to_first_token_seconds", "eagleserve_inter_token_latency_seconds",
                 "eagleserve_spec_accept_length", "eagleserve_spec_verify_calls",
                 "eagleserve_num_requests_waiting"):  # fmt: skip
        assert want in names
    before = {
        n: metric(http, n)
        for n in ("eagleserve_requests_total", "eagleserve_generation_tokens_total",
                  "eagleserve_prompt_tokens_total", "eagleserve_time_to_first_token_seconds_count")
    }  # fmt: skip
    http.post("/v1/completions", json={**GOOD, "max_tokens": 4, "ignore_eos": True})
    time.sleep(0.1)
    assert metric(http, "eagleserve_requests_total") == before["eagleserve_requests_total"] + 1
    gen = metric(http, "eagleserve_generation_tokens_total")
    assert gen == before["eagleserve_generation_tokens_total"] + 4
    assert metric(http, "eagleserve_prompt_tokens_total") > before["eagleserve_prompt_tokens_total"]
    ttft = metric(http, "eagleserve_time_to_first_token_seconds_count")
    assert ttft == before["eagleserve_time_to_first_token_seconds_count"] + 1
    assert metric(http, "eagleserve_kv_total_tokens") > 0


def test_engine_death_gives_503() -> None:
    srv = ServerProcess(["--max-total-tokens", "512"])
    try:
        pid = srv.proc.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        assert children, "no engine process found"
        results: list[httpx.Response] = []
        body = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True}
        t = threading.Thread(
            target=lambda: results.append(httpx.post(srv.url + "/v1/completions", json=body))
        )
        t.start()
        time.sleep(1.0)
        for child in children:
            os.kill(child, signal.SIGKILL)
        t.join(30)
        assert results and results[0].status_code == 503, results
        assert results[0].json()["error"]["type"] == "service_unavailable"
        assert httpx.get(srv.url + "/health").status_code == 503
        with httpx.Client(base_url=srv.url) as http:
            assert metric(http, "eagleserve_engine_alive") == 0
        again = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert again.status_code == 503
    finally:
        srv.stop()
