"""Protocol models and per-choice bookkeeping without a server."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import Completion
from pydantic import ValidationError
from server_fixtures import tokenizer_fixture  # noqa: F401 (fixture)

from eagleserve.messages import TokenOutput
from eagleserve.sampling_params import SamplingParams
from eagleserve.server.answers import CompletionChoice, CompletionResponse, UsageInfo
from eagleserve.server.choices import ChoiceState, usage_of
from eagleserve.server.protocol import ChatCompletionRequest, CompletionRequest, error_body


def test_usage_spec_accept_length_only_when_reported() -> None:
    assert "spec_accept_length" not in UsageInfo(prompt_tokens=1).model_dump()
    assert UsageInfo(spec_accept_length=2.5).model_dump()["spec_accept_length"] == 2.5


def test_spec_accept_length_reaches_usage_and_openai_parses_it(tokenizer: Any) -> None:
    choices = [ChoiceState(i, 0, tokenizer, SamplingParams()) for i in range(2)]
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    for c, spec in zip(choices, (2.0, 3.0), strict=True):
        c.feed(TokenOutput("r", ids, True, "length", prompt_tokens=4,
                           completion_tokens=len(ids), spec_accept_length=spec))  # fmt: skip
    usage = usage_of(choices)
    assert usage.prompt_tokens == 4 and usage.completion_tokens == 2 * len(ids)
    assert usage.spec_accept_length == 2.5
    body = CompletionResponse(
        id="x",
        model="m",
        choices=[CompletionChoice(index=0, text="Hello there", finish_reason="length")],
        usage=usage,
    ).model_dump()
    parsed = Completion.model_validate(body)
    assert parsed.usage.model_extra["spec_accept_length"] == 2.5


def test_prompt_forms() -> None:
    for prompt in ("a", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert CompletionRequest(prompt=prompt).prompt == prompt
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=3.5)
    assert CompletionRequest(prompt="a").max_tokens == 16  # OpenAI's default


def test_chat_content_parts_and_stop_list() -> None:
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "text", "text": "b"}]}],
        stop="x",
    )  # fmt: skip
    assert req.messages[0].text() == "ab" and req.stop_list == ["x"]


def test_error_body_shape() -> None:
    body = error_body(400, "bad", "n")
    assert body == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }
