"""/metrics series a Prometheus user relies on (issue #20 item 6): a model_name label on every
eagleserve_* series, HTTP codes, aborted requests, length, queue-time and prefill-time
histograms, engine liveness, and the standard process_* metrics."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    ServerProcess,
    http_fixture,
    metric,
    server_fixture,
)

GOOD = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0}


def test_every_series_has_the_model_name_and_process_metrics_exist(http: httpx.Client) -> None:
    http.post("/v1/completions", json=GOOD)
    families = list(text_string_to_metric_families(http.get("/metrics").text))
    ours = [s for f in families if f.name.startswith("eagleserve_") for s in f.samples]
    assert len(ours) > 20
    assert all(s.labels.get("model_name") == MODEL for s in ours), [
        s.name for s in ours if s.labels.get("model_name") != MODEL
    ]
    names = {f.name for f in families}
    assert {"process_cpu_seconds", "process_resident_memory_bytes"} <= names
    assert metric(http, "eagleserve_engine_alive") == 1


def test_http_status_codes_are_counted(http: httpx.Client) -> None:
    def count(route: str, code: str) -> float:
        return metric(http, "eagleserve_http_responses_total", route=route, code=code)

    before = (count("/v1/completions", "400"), count("other", "404"),
              count("/v1/completions", "200"))  # fmt: skip
    assert http.post("/v1/completions", json={"prompt": "hi", "top_p": 7}).status_code == 400
    assert http.get("/v1/no-such-route/123").status_code == 404
    assert http.post("/v1/completions", json=GOOD).status_code == 200
    after = (count("/v1/completions", "400"), count("other", "404"),
             count("/v1/completions", "200"))  # fmt: skip
    assert after == (before[0] + 1, before[1] + 1, before[2] + 1)


def test_length_histograms(http: httpx.Client) -> None:
    gen = "eagleserve_request_generation_tokens"
    count0, sum0 = metric(http, gen + "_count"), metric(http, gen + "_sum")
    prompt0 = metric(http, "eagleserve_request_prompt_tokens_sum")
    resp = http.post("/v1/completions", json={**GOOD, "n": 2}).json()
    assert metric(http, gen + "_count") == count0 + 2
    assert metric(http, gen + "_sum") == sum0 + 8
    prompt = metric(http, "eagleserve_request_prompt_tokens_sum") - prompt0
    assert prompt == 2 * resp["usage"]["prompt_tokens"]


def test_queue_and_prefill_time_histograms(http: httpx.Client) -> None:
    """One observation of each per request (n choices: n requests), each within the call."""
    names = ("eagleserve_request_queue_time_seconds", "eagleserve_request_prefill_time_seconds")
    before = [(metric(http, n + "_count"), metric(http, n + "_sum")) for n in names]
    t0 = time.monotonic()
    body = {**GOOD, "prompt": "Hello " * 200, "n": 3, "temperature": 1.0}
    assert http.post("/v1/completions", json=body).status_code == 200
    wall = time.monotonic() - t0
    for name, (count, total) in zip(names, before, strict=True):
        assert metric(http, name + "_count") == count + 3, name
        added = metric(http, name + "_sum") - total
        assert 0 <= added < 3 * wall, name
    assert metric(http, names[1] + "_sum") > before[1][1]  # a 200-word prefill takes time


def test_client_disconnect_is_counted_as_aborted(server: ServerProcess, http: httpx.Client) -> None:
    def aborted() -> float:
        return metric(http, "eagleserve_requests_aborted_total", reason="client_disconnected")

    before = aborted()
    body = {**GOOD, "max_tokens": 3000, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    break
    deadline = time.monotonic() + 30
    while aborted() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborted() == before + 1
    abort = metric(http, "eagleserve_requests_total", finish_reason="abort")
    assert abort >= 1


def test_speculative_depth_series_follow_engine_stats() -> None:
    """Chosen draft depths, proposed tokens and the acceptance EMA, from two stats snapshots."""
    from eagleserve.messages import EngineStats
    from eagleserve.server.metrics import Metrics

    m = Metrics("m")
    m.update_engine_stats(
        EngineStats(spec_proposed_tokens_total=9, spec_iterations_per_num_drafts=[4, 1, 0, 2],
                    spec_acceptance_ema=[0.7, 0.4, 0.1])
    )  # fmt: skip
    m.update_engine_stats(
        EngineStats(spec_proposed_tokens_total=15, spec_iterations_per_num_drafts=[10, 1, 3, 2],
                    spec_acceptance_ema=[0.6, 0.3, 0.2])
    )  # fmt: skip
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(m.render().decode())
        for s in fam.samples
        if s.name.startswith("eagleserve_spec")
    }
    it = "eagleserve_spec_iterations_total"
    assert got[(it, (("model_name", "m"), ("num_drafts", "0")))] == 10
    assert got[(it, (("model_name", "m"), ("num_drafts", "2")))] == 3
    assert got[("eagleserve_spec_proposed_tokens_total", (("model_name", "m"),))] == 15
    ema = "eagleserve_spec_acceptance_ema"
    assert got[(ema, (("depth", "1"), ("model_name", "m")))] == 0.3
