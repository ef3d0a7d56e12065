"""The OpenAPI document's bodies of the POST routes (the handlers parse their bodies
themselves, to answer in OpenAI's error format, so FastAPI cannot see them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from eagleserve.server.answers import ChatCompletionResponse, CompletionResponse
from eagleserve.server.generate import (
    AbortRequest,
    AbortResult,
    GenerateAnswer,
    GenerateRequest,
)
from eagleserve.server.profiling import ProfileAnswer, StartProfileRequest
from eagleserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from eagleserve.server.responses_protocol import ResponseObject, ResponsesRequest

API_BODIES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (CompletionRequest, CompletionResponse),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
    "/v1/responses": (ResponsesRequest, ResponseObject),
    "/tokenize": (TokenizeRequest, TokenizeResponse),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse),
    "/generate": (GenerateRequest, GenerateAnswer),
    "/abort_request": (AbortRequest, AbortResult),
    "/start_profile": (StartProfileRequest, ProfileAnswer),
}
OPTIONAL_BODIES = ("/start_profile",)  # vLLM's clients send none


def add_api_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    """Adds the request body, the 200 body (JSON; `stream: true` answers text/event-stream)
    and the error body of each POST route in API_BODIES to a FastAPI OpenAPI document."""
    models = [(m, mode) for req, resp in API_BODIES.values() for m, mode in
              ((req, "validation"), (resp, "serialization"))]  # fmt: skip
    models.append((ErrorResponse, "serialization"))
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))

    def body(model: type[BaseModel], mode: str) -> dict[str, Any]:
        return {"application/json": {"schema": refs[(model, mode)]}}

    for path, (req, resp) in API_BODIES.items():
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": path not in OPTIONAL_BODIES,
                             "content": body(req, "validation")}  # fmt: skip
        ok = body(resp, "serialization")
        if "stream" in req.model_fields:
            ok["text/event-stream"] = {}  # chunks of the 200 body's type; no SSE event schema
        err = {"content": body(ErrorResponse, "serialization")}
        op["responses"] = {
            "200": {"description": "the result (a completion: or an event stream)", "content": ok},
            **{code: {"description": text, **err} for code, text in (
                ("400", "invalid request"), ("401", "bad API key"), ("404", "unknown model"),
                ("413", "request body over --max-request-body-bytes"),
                ("500", "engine error"), ("503", "engine down or shutting down"))},
        }  # fmt: skip
    return schema
