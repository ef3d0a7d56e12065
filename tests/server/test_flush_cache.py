"""`POST /flush_cache` (SGLang's): with nothing running it empties the prefix cache, so the same
prompt is computed again from scratch; while a request runs it is refused (400) and the cache
kept. A real `eagleserve serve` on a tiny target."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import httpx
import pytest
from conftest import TINY_VOCAB, save_tiny_model
from server_fixtures import metric, wait_kv_free

from bench.server_proc import Server


@pytest.fixture(scope="module", name="http")
def http_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    path = str(tmp_path_factory.mktemp("flush") / "target")
    save_tiny_model(path, seed=7)
    server = Server(["--model", path, "--device", "cpu", "--dtype", "float32"],
                    env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    server.stop()


def complete(http: httpx.Client, prompt: list[int], max_tokens: int = 4) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_flushed_prompt_is_computed_again(http: httpx.Client) -> None:
    rng = random.Random()
    prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(40, 80))]
    first = complete(http, prompt)
    again = complete(http, prompt)
    assert cached(again) > len(prompt) // 2  # the prefix cache kept it
    assert metric(http, "eagleserve_kv_cached_tokens") > 0
    resp = http.post("/flush_cache")
    assert resp.status_code == 200, resp.text
    assert resp.json()["flushed"] and resp.json()["freed_tokens"] >= cached(again)
    assert metric(http, "eagleserve_kv_cached_tokens") == 0
    third = complete(http, prompt)
    assert cached(third) == 0
    assert third["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_flush_while_a_request_runs_is_refused(http: httpx.Client) -> None:
    prompt = [random.randrange(3, TINY_VOCAB) for _ in range(30)]
    complete(http, prompt)  # cached
    started = threading.Event()

    def long_request() -> None:
        body = {"prompt": [5, 6], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.Client(base_url=str(http.base_url), timeout=120) as own:
            with own.stream("POST", "/v1/completions", json=body) as resp:
                for _ in resp.iter_lines():
                    started.set()

    runner = threading.Thread(target=long_request)
    runner.start()
    assert started.wait(60)
    busy = http.post("/flush_cache")
    runner.join()
    assert busy.status_code == 400 and "not flushed" in busy.json()["error"]["message"]
    wait_kv_free(http)
    assert cached(complete(http, prompt)) > 0  # the refused flush kept the cache
