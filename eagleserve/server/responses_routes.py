"""The Responses API's routes under /v1: create (server/responses.py), read, stream again,
list input items, cancel and delete stored responses (server/response_store.py,
server/background.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eagleserve.server.background import BackgroundResponses, not_found
from eagleserve.server.protocol import ErrorResponse
from eagleserve.server.response_store import ResponseStore, page_of_items
from eagleserve.server.responses import create_response
from eagleserve.server.responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest
from eagleserve.server.serving import ApiError, Serving

NOT_STORED = {404: {"model": ErrorResponse, "description": "not stored"}}
NOT_RUNNING = {400: {"model": ErrorResponse, "description": "not a running background response"}}


def add_responses_routes(
    v1: APIRouter,
    serving: Serving,
    store: ResponseStore,
    background: BackgroundResponses,
    read_json: Callable[[Request, type[ResponsesRequest]], Awaitable[ResponsesRequest | Response]],
    unavailable: Callable[[], Response | None],
) -> None:
    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        body = await read_json(request, ResponsesRequest)
        if isinstance(body, Response):
            return body
        return unavailable() or await create_response(serving, store, background, body, request)

    @v1.get("/responses/{response_id}", response_model=ResponseObject, responses=NOT_STORED)
    async def get_response(
        response_id: str, stream: bool = False, starting_after: int | None = Query(None, ge=0)
    ) -> Response:
        """The stored response; with `stream`, a streamed background response's events again
        (after `starting_after`), live while it runs."""
        if stream:
            events = background.stream(response_id, starting_after)
            if isinstance(events, ApiError):
                return events.response()
            return StreamingResponse(events, media_type="text/event-stream")
        entry = store.get(response_id)
        if entry is None:
            return not_found(response_id).response()
        return JSONResponse(entry.response)

    @v1.get("/responses/{response_id}/input_items", responses=NOT_STORED)
    async def response_input_items(
        response_id: str, limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc", after: str | None = None,
        before: str | None = None,
    ) -> Response:  # fmt: skip
        """OpenAI's list of a stored response's input items (newest first by default)."""
        entry = store.get(response_id)
        if entry is None:
            return not_found(response_id).response()
        page = page_of_items(entry.input_items, limit, order, after, before)
        if isinstance(page, str):  # the cursor that names no item of this response
            cursor = after if page == "after" else before
            return ApiError(400, f"no input item {cursor!r} in this response", page).response()
        return JSONResponse(page)

    @v1.post("/responses/{response_id}/cancel", response_model=ResponseObject,
             responses={**NOT_STORED, **NOT_RUNNING})  # fmt: skip
    async def cancel_response(response_id: str) -> Response:
        """Ends a background response; its output so far is kept, its status cancelled."""
        answer = await background.cancel(response_id)
        return answer.response() if isinstance(answer, ApiError) else JSONResponse(answer)

    @v1.delete("/responses/{response_id}", response_model=DeletedResponse, responses=NOT_STORED)
    async def delete_response(response_id: str) -> Response:
        if not await background.delete(response_id):
            return not_found(response_id).response()
        return JSONResponse(DeletedResponse(id=response_id).model_dump())
