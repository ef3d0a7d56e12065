"""Request fields the engine cannot honour yet are a 400 naming them, never silently ignored
(issue #20 item 2), vLLM's extensions too; their neutral values (what many clients always send)
still work; vLLM's include_stop_str_in_output, skip_special_tokens and truncate_prompt_tokens
are honoured. Fields it honours (penalties, logit_bias, min_tokens, echo + logprobs:
test_penalties_api.py; structured output and tools: test_structured_api.py,
test_tool_calls_api.py) are 400s only when invalid."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    base_url_fixture,
    http_fixture,
    server_fixture,
)

CMPL = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (path, extra fields, the `param` the 400 must name, whether it is "not supported")
REJECTED: list[tuple[str, dict[str, Any], str, bool]] = [
    ("/v1/completions", {"frequency_penalty": 5.0}, "frequency_penalty", False),  # OpenAI: -2..2
    ("/v1/chat/completions", {"presence_penalty": -2.5}, "presence_penalty", False),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", False),
    ("/v1/completions", {"logit_bias": {"11": -101}}, "logit_bias.11", False),
    ("/v1/completions", {"logit_bias": {"comma": 1}}, "logit_bias", False),
    ("/v1/completions", {"logit_bias": {"-3": 1}}, "logit_bias", False),
    ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias", False),  # past the vocab
    ("/v1/completions", {"min_tokens": 3}, "min_tokens", False),  # more than max_tokens (2)
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", False),  # 0 only with echo
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.schema", False),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", False),  # no tools
    ("/v1/chat/completions", {"functions": [TOOL["function"]]}, "functions", True),
    ("/v1/completions", {"best_of": 3}, "best_of", True),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of", False),
    ("/v1/completions", {"suffix": " world"}, "suffix", True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [IMAGE]}]},
     "messages.0.content.0.type", True),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", False),
    # vLLM's extensions that change the output and are not implemented (server/vllm_fields.py)
    ("/v1/completions", {"use_beam_search": True, "n": 12}, "n", False),
    ("/v1/completions", {"spaces_between_special_tokens": False},
     "spaces_between_special_tokens", True),
    ("/v1/chat/completions", {"echo": True}, "echo", True),
    ("/v1/chat/completions", {"allowed_token_ids": []}, "allowed_token_ids", False),
    ("/v1/completions", {"allowed_token_ids": [5, 99999999]}, "allowed_token_ids", False),
    ("/v1/completions", {"bad_words": ["x", " "]}, "bad_words", False),
    ("/v1/completions", {"bad_words": [f"w{i}" for i in range(129)]}, "bad_words", False),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs", True),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs", False),
    ("/v1/chat/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", False),
    ("/v1/completions", {"length_penalty": 0.5}, "length_penalty", False),  # beams only
    ("/v1/completions", {"priority": 3}, "priority", False),  # priority scheduling is off
    ("/v1/chat/completions", {"logits_processors": ["m.P"]}, "logits_processors", True),
    ("/v1/chat/completions", {"guided_json": "{not json"}, "guided_json", False),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice", False),
    ("/v1/completions", {"guided_regex": "a", "regex": "b"}, "guided_regex", False),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs.choice", False),
    ("/v1/completions", {"structured_outputs": {"disable_any_whitespace": True}},
     "structured_outputs", False),
]  # fmt: skip


@pytest.mark.parametrize(("path", "extra", "param", "unsupported"), REJECTED)
def test_field_the_server_cannot_honour_is_400_naming_it(
    http: httpx.Client, path: str, extra: dict[str, Any], param: str, unsupported: bool
) -> None:
    base = CHAT if "chat" in path else CMPL
    resp = http.post(path, json={**base, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and param.split(".")[0] in err["message"]
    assert (err["code"] == "unsupported_parameter") == unsupported, err


NEUTRAL: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"presence_penalty": 0, "frequency_penalty": 0.0,
                         "repetition_penalty": 1.0, "min_tokens": 0, "logit_bias": {}}),
    ("/v1/completions", {"presence_penalty": 1.5, "frequency_penalty": -0.5,
                         "repetition_penalty": 1.3, "min_tokens": 2, "logit_bias": {"11": -100}}),
    ("/v1/completions", {"echo": True, "logprobs": 2}),
    ("/v1/chat/completions", {"presence_penalty": -2, "logit_bias": {"0": 100},
                              "min_tokens": 1}),
    ("/v1/completions", {"best_of": 2, "n": 2, "suffix": ""}),
    ("/v1/completions", {"best_of": 1, "echo": True}),
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tool_choice": "none",
                              "tools": [], "top_logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user",
                                            "content": [{"type": "text", "text": "Hi"}]}]}),
    ("/v1/completions", {"use_beam_search": False, "include_stop_str_in_output": False,
                         "skip_special_tokens": True, "spaces_between_special_tokens": True,
                         "length_penalty": 1.0, "truncate_prompt_tokens": None,
                         "allowed_token_ids": None, "bad_words": [], "guided_json": None,
                         "priority": 0, "logits_processors": None, "cache_salt": None,
                         "structured_outputs": {"regex": None, "disable_fallback": False}}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "extra"), NEUTRAL)
def test_neutral_values_are_accepted(http: httpx.Client, path: str, extra: dict[str, Any]) -> None:
    base = CHAT if "chat" in path else CMPL
    resp = http.post(path, json={**base, **extra})
    assert resp.status_code == 200, resp.text
    assert all(c["finish_reason"] for c in resp.json()["choices"])


def test_openai_client_gets_bad_request(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="1, 2,", max_tokens=4, suffix="!")
    assert "suffix" in str(exc.value)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
            functions=[TOOL["function"]],
        )  # fmt: skip
    assert "functions" in str(exc.value)


def test_include_stop_str_in_output_keeps_the_stop_string(http: httpx.Client) -> None:
    """vLLM's include_stop_str_in_output (and SGLang's no_stop_trim, the same): the text ends
    with the stop string, streamed or not."""
    body = {"prompt": "List the days of the week:", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    words = [w for w in free.split() if len(w) > 3]
    assert words, free
    stop = words[len(words) // 2]
    head = free[: free.index(stop)]
    for stream in (False, True):
        for include, field in ((False, "no_stop_trim"), (True, "include_stop_str_in_output"),
                               (True, "no_stop_trim")):  # fmt: skip
            asked = {**body, "stop": [stop], field: include, "stream": stream}
            resp = http.post("/v1/completions", json=asked)
            text = (
                "".join(
                    json.loads(line[6:])["choices"][0]["text"]
                    for line in resp.text.splitlines()
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]
                )
                if stream
                else resp.json()["choices"][0]["text"]
            )
            assert text == head + stop * include, (stream, include, text)


def test_truncate_prompt_tokens_keeps_the_prompts_tail(http: httpx.Client) -> None:
    rng = random.Random()
    ids = [rng.randrange(100, 20000) for _ in range(rng.randint(30, 60))]
    k = rng.randint(5, 20)
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cut = http.post("/v1/completions", json={**body, "prompt": ids, "truncate_prompt_tokens": k})
    tail = http.post("/v1/completions", json={**body, "prompt": ids[-k:]})
    assert cut.json()["usage"]["prompt_tokens"] == k
    assert cut.json()["choices"][0]["text"] == tail.json()["choices"][0]["text"]
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    chat = http.post("/v1/chat/completions", json={**body, "messages": msgs,
                                                   "truncate_prompt_tokens": k})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == k
    bad = http.post("/v1/completions", json={**body, "prompt": ids, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_skip_special_tokens_false_shows_them(http: httpx.Client) -> None:
    """vLLM's skip_special_tokens false: the special tokens of the answer show; the EOS that
    ended it only with include_stop_str_in_output (as vLLM)."""
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 60,
            "temperature": 0}  # fmt: skip
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert plain["finish_reason"] == "stop"  # by its EOS, <|im_end|>
    text = plain["message"]["content"]
    shown = http.post("/v1/chat/completions", json={**body, "skip_special_tokens": False}).json()
    assert shown["choices"][0]["message"]["content"] == text
    both = {**body, "skip_special_tokens": False, "include_stop_str_in_output": True}
    kept = http.post("/v1/chat/completions", json=both).json()["choices"][0]["message"]["content"]
    assert kept == text + "<|im_end|>"
    hidden = {**body, "include_stop_str_in_output": True}  # the EOS, a special token: not shown
    assert (
        http.post("/v1/chat/completions", json=hidden).json()["choices"][0]["message"]["content"]
        == text
    )
