"""`--sampling-defaults` (server/sampling_defaults.py): a request that leaves temperature, top_k
and repetition_penalty unset samples with the model's generation_config.json values (the same
tokens as a request that sends them, seed for seed); a chat without max_tokens stops at its
max_new_tokens; `openai` ignores the file; a value out of range stops the start (one line,
exit code 2) naming the file and the key."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import save_tiny_model
from server_fixtures import ServerProcess
from test_startup import assert_one_line_exit_2, run_serve

from eagleserve.server.sampling_defaults import SamplingDefaults, read_sampling_defaults

TEMPLATE = "{% for m in messages %}{{ m.content }}\\n{% endfor %}"
GENERATION = {"temperature": 0.5, "top_k": 3, "repetition_penalty": 1.3,
              "max_new_tokens": random.randint(5, 12), "do_sample": True}  # fmt: skip


def tiny_model(path: Path, generation: dict[str, Any]) -> str:
    save_tiny_model(str(path), seed=0)
    with open(path / "generation_config.json") as f:
        config = json.load(f)
    with open(path / "generation_config.json", "w") as f:
        json.dump({**config, **generation}, f)
    return str(path)


@pytest.fixture(scope="module", name="server")
def server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = tiny_model(tmp_path_factory.mktemp("tiny"), GENERATION)
    srv = ServerProcess(["--model", model, "--chat-template", TEMPLATE])
    yield srv
    srv.stop()


def completion(http: httpx.Client, **fields: Any) -> list[int]:
    body = {"prompt": "abcabc", "max_tokens": 16, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, **fields}  # fmt: skip
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


def test_unset_fields_take_the_models_values(server: ServerProcess) -> None:
    explicit = {k: GENERATION[k] for k in ("temperature", "top_k", "repetition_penalty")}
    openai = {"temperature": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    seeds = random.sample(range(10**6), 4)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        unset = [completion(http, seed=s) for s in seeds]
        assert unset == [completion(http, seed=s, **explicit) for s in seeds]
        assert unset != [completion(http, seed=s, **openai) for s in seeds]
        ask = {"messages": [{"role": "user", "content": "abc"}], "ignore_eos": True}
        chat = http.post("/v1/chat/completions", json=ask).json()
    assert chat["usage"]["completion_tokens"] == GENERATION["max_new_tokens"]


def test_reading_the_defaults(tmp_path: Path) -> None:
    values = {"temperature": round(random.uniform(0, 2), 3), "top_p": random.uniform(0.1, 1),
              "top_k": random.choice([0, 7]), "min_p": 0.05, "repetition_penalty": 1.1}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps({**values, "do_sample": True}))
    got = read_sampling_defaults(str(tmp_path), "model")
    assert got == SamplingDefaults(**{**values, "top_k": values["top_k"] or -1})  # HF's 0: off
    assert read_sampling_defaults(str(tmp_path), "openai") == SamplingDefaults()
    assert read_sampling_defaults(str(tmp_path / "nowhere"), "model") == SamplingDefaults()
    with pytest.raises(ValueError, match="--sampling-defaults"):
        read_sampling_defaults(str(tmp_path), "vllm")
    for key, bad in [("temperature", -0.5), ("top_p", 0), ("top_k", 2.5), ("min_p", "x"),
                     ("repetition_penalty", 0), ("max_new_tokens", 0)]:  # fmt: skip
        (tmp_path / "generation_config.json").write_text(json.dumps({key: bad}))
        with pytest.raises(ValueError, match=key):
            read_sampling_defaults(str(tmp_path), "model")


def test_a_value_out_of_range_stops_the_start(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "m", {"temperature": -1})
    proc = run_serve(["--model", model])
    assert_one_line_exit_2(proc, os.path.join(model, "generation_config.json"), "temperature")
