"""The FastAPI app: OpenAI-compatible routes, health, metrics, errors in OpenAI's format."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagleserve.config import ServerArgs
from eagleserve.server.engine_client import EngineClient
from eagleserve.server.handlers import create_chat, create_completion
from eagleserve.server.limits import read_body
from eagleserve.server.metrics import Metrics
from eagleserve.server.middleware import HttpStats, HttpTrackerMiddleware
from eagleserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    add_api_bodies,
)
from eagleserve.server.serving import ApiError, Serving
from eagleserve.server.validation import check_request

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def validation_error(errors: list[dict]) -> ApiError:
    """The first pydantic / FastAPI validation error as a 400."""
    if not errors:
        return ApiError(400, "invalid request body")
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {err.get('msg', '')}")
    param = ".".join(loc) or None
    return ApiError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param)


def parse_body(model: type[M], raw: bytes) -> M | ApiError:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:  # pydantic reports bad input only by raising
        return validation_error(exc.errors(include_url=False))


def create_app(args: ServerArgs, client: EngineClient, http: HttpStats | None = None) -> FastAPI:
    metrics = Metrics(args.served_model_name or args.model)
    http = http or HttpStats()
    http.on_status = metrics.http_response
    client.on_stats = metrics.update_engine_stats
    serving = Serving(args, client, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not client.started:
            await client.start()
        metrics.update_engine_stats(client.last_stats)
        yield
        await client.shutdown()

    app = FastAPI(title="eagleserve", lifespan=lifespan)
    app.add_middleware(HttpTrackerMiddleware, stats=http)
    app.state.serving = serving

    async def require_key(request: Request) -> None:
        if args.api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, f"Bearer {args.api_key}".encode()):
            raise StarletteHTTPException(401, "invalid or missing API key")

    def unavailable() -> Response | None:
        if client.draining:
            return ApiError(503, "the server is shutting down").response()
        if client.healthy:
            return None
        return ApiError(503, "the engine is not running").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "invalid_api_key" if exc.status_code == 401 else None
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(RequestValidationError)
    async def request_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    async def read_request(request: Request, model: type[R]) -> R | Response:
        """The parsed and checked body, or the error response (413, 400, 404) to send."""
        raw = await read_body(request, args.max_request_body_bytes)
        if isinstance(raw, ApiError):
            resp = raw.response()
            resp.headers["connection"] = "close"  # the rest of the body is not read
            return resp
        body = parse_body(model, raw)
        if isinstance(body, ApiError):
            return body.response()
        err = serving.check_model(body.model) or check_request(body)
        return err.response() if err is not None else body

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_request(request, CompletionRequest)
        if isinstance(body, Response):
            return body
        return unavailable() or await create_completion(serving, body, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_request(request, ChatCompletionRequest)
        if isinstance(body, Response):
            return body
        return unavailable() or await create_chat(serving, body, request)

    @v1.get("/models", response_model=ModelList)
    async def models() -> JSONResponse:
        card = ModelCard(id=serving.model_name, max_model_len=client.max_context_len or None)
        return JSONResponse(ModelList(data=[card]).model_dump())

    app.include_router(v1)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_api_bodies(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/health")
    async def health() -> Response:
        return unavailable() or JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.update_engine_stats(await client.get_stats())
        metrics.engine_alive.set(1 if client.healthy else 0)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
