"""A Responses API response as it runs (server/responses.py creates it): the response object
OpenAI's clients read, its output items once its answer is whole, and what the response store
keeps of it. Its stream's events are server/responses_stream.py's."""

from __future__ import annotations

from typing import Any

from eagleserve.server.chat import ChatCall
from eagleserve.server.choices import ChoiceState, usage_of
from eagleserve.server.protocol import ChatMessage, now
from eagleserve.server.response_store import ResponseStore, StoredResponse
from eagleserve.server.responses_input import listed_input_items
from eagleserve.server.responses_protocol import (
    FunctionCall,
    IncompleteDetails,
    InputTokensDetails,
    Item,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    Status,
    item_id,
)
from eagleserve.server.serving import ApiError, Serving


def status_of(reason: str | None) -> Status:
    if reason == "length":
        return "incomplete"
    return "cancelled" if reason == "abort" else "completed"


class ResponseRun:
    """One response's output items and object, from its chat call's choice, and its state:
    queued (a background one, until its first output), in progress, finished or failed."""

    def __init__(
        self,
        serving: Serving,
        body: ResponsesRequest,
        call: ChatCall,
        conversation: list[ChatMessage],
        stored: bool,
    ) -> None:
        self.body, self.call, self.conversation, self.stored = body, call, conversation, stored
        self.id, self.message_id, self.created = item_id("resp"), item_id("msg"), now()
        self.reasoning_id = item_id("rs")
        self.model = serving.model_name
        self._finished: ResponseObject | None = None
        self.error: ApiError | None = None
        # A background response is queued until its first output, and keeps its stream's
        # events (a client may read them again, from any point: server/background.py).
        self.background = bool(body.background)
        self.status: Status = "queued" if self.background else "in_progress"
        self.log: list[str] | None = [] if self.background and body.stream else None

    @property
    def choice(self) -> ChoiceState:
        return self.call.tracker.ordered[0]

    def logprobs(self, only_new: bool = False) -> list[Any] | None:
        if not self.call.body.logprobs:
            return None
        return self.choice.chat_logprobs(only_new=only_new).content or []

    def response(
        self,
        status: Status,
        output: list[Item] | None = None,
        error: ApiError | None = None,
    ) -> ResponseObject:
        body, usage = self.body, None
        if status not in ("queued", "in_progress"):
            u = usage_of(self.call.tracker.ordered)
            details = InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens)
            usage = ResponseUsage(
                input_tokens=u.prompt_tokens,
                input_tokens_details=details,
                output_tokens=u.completion_tokens,
                total_tokens=u.total_tokens,
            )
        text = body.text.model_dump(by_alias=True) if body.text else {"format": {"type": "text"}}
        failed = (
            None if error is None else ResponseError(code="server_error", message=error.message)
        )
        cut = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,
            background=self.background,
            model=self.model,
            output=output or [],
            usage=usage,
            instructions=body.instructions,
            error=failed,
            incomplete_details=cut,
            max_output_tokens=body.max_output_tokens,
            reasoning=body.reasoning,
            truncation=body.truncation or "disabled",
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            store=self.stored,
            temperature=body.temperature,
            top_p=body.top_p,
            text=text,
            tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
            tools=body.tools or [],
            top_logprobs=body.top_logprobs,
            user=body.user,
            metadata=body.metadata or {},
        )

    def finished(self) -> ResponseObject:
        """The finished response (made once: its function calls get their ids once)."""
        if self._finished is not None:
            return self._finished
        answer = self.call.answer(self.choice)
        content, calls = answer.content, answer.tool_calls
        status = status_of(self.choice.finish_reason)
        item_status: Status = "incomplete" if status == "incomplete" else "completed"
        output: list[Item] = []
        if answer.reasoning:
            thought = [ReasoningText(text=answer.reasoning)]
            # Thinking that ended (an answer follows it) is whole, whatever cut the answer.
            ended: Status = "completed" if content is not None else item_status
            output.append(ReasoningItem(id=self.reasoning_id, content=thought, status=ended))
        if content or not calls:
            text = OutputText(text=content or "", logprobs=self.logprobs())
            output.append(OutputMessage(id=self.message_id, status=item_status, content=[text]))
        output += [
            FunctionCall(
                id=item_id("fc"),
                call_id=c["id"],
                name=c["function"]["name"],
                arguments=c["function"]["arguments"],
                status=item_status,
            )
            for c in calls
        ]
        self._finished = self.response(status, output)
        self.status = status
        return self._finished

    def fail(self, err: ApiError) -> None:
        self.error, self.status = err, "failed"

    def stored_entry(self) -> StoredResponse:
        """The response as kept now: failed, still queued or in progress (a background one;
        no answer to continue from yet), or finished, its answer after its conversation."""
        listed = listed_input_items(self.body)
        events = None if self.log is None else tuple(self.log)
        if self.error is not None or not self.choice.finished:
            now_ = self.response(self.status, error=self.error).model_dump()
            return StoredResponse(now_, tuple(self.conversation), listed, events)
        resp = self.finished()
        text = "".join(
            p.text for m in resp.output if isinstance(m, OutputMessage) for p in m.content
        )
        tool_calls = [
            {
                "id": f.call_id,
                "type": "function",
                "function": {"name": f.name, "arguments": f.arguments},
            }
            for f in resp.output
            if isinstance(f, FunctionCall)
        ]
        answer = ChatMessage(role="assistant", content=text or None, tool_calls=tool_calls or None)
        return StoredResponse(resp.model_dump(), (*self.conversation, answer), listed, events)

    def store_into(self, store: ResponseStore) -> None:
        """Keeps the response and its conversation for a later turn."""
        if self.stored:
            store.put(self.stored_entry())
