"""The FastAPI app: OpenAI-compatible routes, health, metrics, errors in OpenAI's format."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import version as package_version
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagleserve.config import ServerArgs
from eagleserve.messages import ProfileReq, ProfileResult
from eagleserve.server.background import BackgroundResponses
from eagleserve.server.chat import create_chat
from eagleserve.server.completions import create_completion
from eagleserve.server.engine_client import EngineClient
from eagleserve.server.generate import (
    AbortRequest,
    AbortResult,
    GenerateRequest,
    create_generate,
)
from eagleserve.server.limits import gc_paused, read_body
from eagleserve.server.metrics import Metrics
from eagleserve.server.middleware import HttpStats, HttpTrackerMiddleware
from eagleserve.server.openapi import add_api_bodies
from eagleserve.server.profiling import (
    ProfileAnswer,
    StartProfileRequest,
    profile_answer,
    profile_request,
)
from eagleserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from eagleserve.server.response_store import ResponseStore
from eagleserve.server.responses_routes import add_responses_routes
from eagleserve.server.serving import ApiError, Serving
from eagleserve.server.sglang_info import model_info, server_info
from eagleserve.server.tokenization import detokenize, tokenize
from eagleserve.server.validation import check_request

HEALTH_TIMEOUT_ENV = "EAGLESERVE_HEALTH_GENERATE_TIMEOUT_S"

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)
T = TypeVar("T", TokenizeRequest, DetokenizeRequest)


def health_timeout_s() -> float:
    """How long /health_generate waits for its token (as SGLang's health check, 20 s)."""
    return float(os.environ.get(HEALTH_TIMEOUT_ENV, "20"))


def is_union_branch(part: object) -> bool:
    """pydantic names the member of a union that failed in `loc` ('str', 'list[int]',
    'ChatContentPart', 'function-after[...]'); a client's `param` names only fields."""
    if not isinstance(part, str):
        return False
    return part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()


def error_fields(err: dict) -> list[str]:
    return [str(x) for x in err.get("loc", ()) if x != "body" and not is_union_branch(x)]


def validation_error(errors: list[dict]) -> ApiError:
    """The first pydantic / FastAPI validation error as a 400 naming its field."""
    if not errors:
        return ApiError(400, "invalid request body")
    # A union reports one error per member; of those about the first bad field, the deepest
    # names what the client got wrong ([{"text": 3}]: messages.0.content.0.text).
    top = error_fields(errors[0])[:1]
    same = [e for e in errors if error_fields(e)[:1] == top]
    err = max(same, key=lambda e: len(error_fields(e)))
    loc = error_fields(err)
    if err.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {err.get('msg', '')}")
    param = ".".join(loc) or None
    return ApiError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param)


def parse_body(model: type[M], raw: bytes) -> M | ApiError:
    try:
        with gc_paused:  # see GcPause: keeps the event loop responsive during big bodies
            return model.model_validate_json(raw)
    except ValidationError as exc:  # pydantic reports bad input only by raising
        return validation_error(exc.errors(include_url=False))


def create_app(args: ServerArgs, client: EngineClient, http: HttpStats | None = None) -> FastAPI:
    metrics = Metrics(args.served_model_name or args.model)
    http = http or HttpStats()
    http.on_status = metrics.http_response
    client.on_stats = metrics.update_engine_stats
    serving = Serving(args, client, metrics)
    stored = ResponseStore(args.responses_store_size)
    background = BackgroundResponses(stored, client)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not client.started:
            await client.start()
        metrics.update_engine_stats(client.last_stats)
        yield
        await background.close()
        await client.shutdown()

    app = FastAPI(title="eagleserve", lifespan=lifespan)
    app.add_middleware(HttpTrackerMiddleware, stats=http,
                       request_id_headers=args.enable_request_id_headers)  # fmt: skip
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    if origins:  # outermost: its headers go on every answer, errors (401, 413) included
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip
    app.state.serving = serving

    async def require_key(request: Request) -> None:
        if args.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        good = secrets.compare_digest(token.strip().encode(), args.api_key.encode())
        if scheme.lower() != "bearer" or not good:  # the scheme is case-insensitive (RFC 9110)
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

    async def read_json(request: Request, model: type[M]) -> M | Response:
        """The parsed body for an existing model's route, or the error response (413, 400,
        404) to send."""
        raw = await read_body(request, args.max_request_body_bytes)
        if isinstance(raw, ApiError):
            resp = raw.response()
            resp.headers["connection"] = "close"  # the rest of the body is not read
            return resp
        # In a thread: validating a 16 MB body of token ids or messages takes 1-3 s.
        body = await asyncio.to_thread(parse_body, model, raw)
        if isinstance(body, ApiError):
            return body.response()
        err = serving.check_model(getattr(body, "model", None))
        return err.response() if err is not None else body

    async def read_request(request: Request, model: type[R]) -> R | Response:
        """read_json, and the checks of the fields the engine cannot honour (400)."""
        body = await read_json(request, model)
        if isinstance(body, Response):
            return body
        err = check_request(body)
        return err.response() if err is not None else body

    async def tokenizer_route(
        request: Request, model: type[T], run: Callable[[Serving, T], BaseModel | ApiError]
    ) -> Response:
        body = await read_json(request, model)
        if isinstance(body, Response):
            return body
        out = await asyncio.to_thread(run, serving, body)  # a long text: off the event loop
        return out.response() if isinstance(out, ApiError) else JSONResponse(out.model_dump())

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

    add_responses_routes(v1, serving, stored, background, read_json, unavailable)

    def model_card() -> ModelCard:
        return ModelCard(id=serving.model_name, max_model_len=client.max_context_len or None)

    @v1.get("/models", response_model=ModelList)
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @v1.get("/models/{model:path}", response_model=ModelCard,
            responses={404: {"model": ErrorResponse, "description": "unknown model"}})  # fmt: skip
    async def model(model: str) -> Response:
        err = serving.check_model(model)
        return err.response() if err is not None else JSONResponse(model_card().model_dump())

    app.include_router(v1)

    # vLLM's tokenizer routes, at the root as in vLLM, behind the API key as /v1 is.
    @app.post("/tokenize", dependencies=[Depends(require_key)])
    async def tokenize_route(request: Request) -> Response:
        return await tokenizer_route(request, TokenizeRequest, tokenize)

    @app.post("/detokenize", dependencies=[Depends(require_key)])
    async def detokenize_route(request: Request) -> Response:
        return await tokenizer_route(request, DetokenizeRequest, detokenize)

    # SGLang's: empties the prefix cache (between benchmark runs, say) if nothing runs.
    @app.post("/flush_cache", dependencies=[Depends(require_key)])
    async def flush_cache() -> Response:
        down = unavailable()
        if down is not None:
            return down
        result = await client.flush_cache()
        down = unavailable()  # the engine died meanwhile: nothing was flushed
        if down is not None:
            return down
        if result.freed_tokens is None:
            msg = "requests are queued or running: the prefix cache was not flushed"
            return ApiError(400, msg).response()
        return JSONResponse({"flushed": True, "freed_tokens": result.freed_tokens})

    # SGLang's and vLLM's: the engine's torch profiler (server/profiling.py). An empty body
    # (vLLM's) starts it with the defaults.
    @app.post("/start_profile", response_model=ProfileAnswer,
              dependencies=[Depends(require_key)])  # fmt: skip
    async def start_profile(request: Request) -> Response:
        body = StartProfileRequest()
        if await request.body():
            body = await read_json(request, StartProfileRequest)
            if isinstance(body, Response):
                return body
        req = profile_request(body)
        if isinstance(req, ApiError):
            return req.response()
        return unavailable() or profiled(await client.profile(req))

    @app.post("/stop_profile", response_model=ProfileAnswer, dependencies=[Depends(require_key)])
    async def stop_profile() -> Response:
        return unavailable() or profiled(await client.profile(ProfileReq(start=False)))

    def profiled(result: ProfileResult) -> Response:
        answer = profile_answer(result)
        if isinstance(answer, ApiError):
            return unavailable() or answer.response()  # the engine died meanwhile: a 503
        return JSONResponse(answer.model_dump())

    # SGLang's native generation route (sglang.bench_serving's `sglang` backend uses it).
    @app.post("/generate", dependencies=[Depends(require_key)])
    async def generate(request: Request) -> Response:
        body = await read_json(request, GenerateRequest)
        if isinstance(body, Response):
            return body
        return unavailable() or await create_generate(serving, body, request)

    @app.post("/abort_request", dependencies=[Depends(require_key)])
    async def abort_request(request: Request) -> Response:
        """SGLang's: ends a request (its id, or the rid it was sent with) or all of them; each
        answers with what it made so far and finish reason abort."""
        body = await read_json(request, AbortRequest)
        if isinstance(body, Response):
            return body
        if not (body.rid or body.abort_all):
            return ApiError(400, "give the rid to abort, or abort_all", "rid").response()
        aborted = client.abort_matching(None if body.abort_all else body.rid)
        return JSONResponse(AbortResult(aborted=aborted).model_dump())

    # SGLang's informational routes (server/sglang_info.py), under both of its names.
    @app.get("/get_model_info", dependencies=[Depends(require_key)])
    @app.get("/model_info", dependencies=[Depends(require_key)])
    async def get_model_info() -> JSONResponse:
        return JSONResponse(model_info(args, client.ready))

    @app.get("/get_server_info", dependencies=[Depends(require_key)])
    @app.get("/server_info", dependencies=[Depends(require_key)])
    async def get_server_info() -> JSONResponse:
        return JSONResponse(server_info(args, client.ready, await client.get_stats()))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": package_version("eagleserve")})

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_api_bodies(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/health")
    async def health() -> Response:
        return unavailable() or JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """SGLang's deeper probe: 200 only if the engine produces a token in time."""
        down = unavailable()
        if down is not None:
            return down
        why = await client.check_generates(health_timeout_s())
        if why is not None:
            return ApiError(503, why).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.update_engine_stats(await client.get_stats())
        metrics.engine_alive.set(1 if client.healthy else 0)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
