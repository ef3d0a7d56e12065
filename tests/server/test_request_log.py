"""SGLang's --log-requests (server/request_log.py): a line as each request arrives and as it
finishes, with the detail --log-requests-level asks for, shown whatever --log-level says."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator

import httpx
import pytest
from server_fixtures import ServerProcess

from eagleserve.messages import GenerateReqInput
from eagleserve.sampling_params import SamplingParams
from eagleserve.server.request_log import PARTIAL_CHARS, finished_line, received_line


class CharTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def logged(line: str) -> dict:
    kind, _, body = line.partition(": ")
    assert kind in ("Receive", "Finish")
    return json.loads(body)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_each_level_logs_what_it_promises(level: int) -> None:
    rng = random.Random()
    text = "".join(rng.choices(string.ascii_letters, k=rng.choice([50, PARTIAL_CHARS + 500])))
    params = SamplingParams(max_new_tokens=rng.randint(2, 99), temperature=0.0)
    req = GenerateReqInput("req-1", [ord(c) for c in text], params, priority=3)
    got = logged(received_line(level, "chat", req, CharTokenizer()))
    assert (got["rid"], got["endpoint"], got["prompt_tokens"], got["priority"]) == (
        "req-1", "chat", len(text), 3)  # fmt: skip
    assert ("sampling_params" in got) == (level >= 1)
    if level >= 1:
        assert got["sampling_params"] == {"max_new_tokens": params.max_new_tokens,
                                          "temperature": 0.0}  # fmt: skip
    assert ("input" in got) == (level >= 2)
    if level == 3 or (level == 2 and len(text) <= PARTIAL_CHARS):
        assert got["input"] == text
    elif level == 2:
        assert got["input"] == text[:PARTIAL_CHARS] + "...(500 more tokens)"
    done = logged(finished_line(level, "req-1", "stop", (5, 7, 2), 0.123456, text))
    short = level == 3 or len(text) <= PARTIAL_CHARS
    output = text if short else text[:PARTIAL_CHARS] + "...(500 more characters)"
    assert done == {"rid": "req-1", "finish_reason": "stop", "prompt_tokens": 5,
                    "completion_tokens": 7, "cached_tokens": 2, "e2e_latency": 0.1235,
                    **({"output": output} if level >= 2 else {})}  # fmt: skip


@pytest.fixture(scope="module", name="logging_server")
def logging_server_fixture() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--log-requests", "--log-requests-level", "2"])  # --log-level warning
    yield srv
    srv.stop()


def test_the_server_logs_each_request_in_and_out(logging_server: ServerProcess) -> None:
    marker = "".join(random.choices(string.ascii_lowercase, k=12))
    n = random.randint(3, 9)
    with httpx.Client(base_url=logging_server.url, timeout=120) as http:
        body = {"prompt": f"Say {marker}:", "max_tokens": n, "temperature": 0, "ignore_eos": True}
        answer = http.post("/v1/completions", json=body).json()
    logging_server.log.seek(0)
    tag = "eagleserve.requests: "
    log = logging_server.log.read().splitlines()
    lines = [ln.split(tag, 1)[1] for ln in log if tag in ln]
    received = [logged(ln) for ln in lines if ln.startswith("Receive") and marker in ln]
    assert len(received) == 1, lines
    rid = received[0]["rid"]
    assert received[0]["sampling_params"]["max_new_tokens"] == n
    assert received[0]["input"].endswith(f"Say {marker}:")
    (finished,) = [logged(ln) for ln in lines if ln.startswith("Finish") and rid in ln]
    assert finished["completion_tokens"] == answer["usage"]["completion_tokens"] == n
    assert finished["output"] == answer["choices"][0]["text"]
