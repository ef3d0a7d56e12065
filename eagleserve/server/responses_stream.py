"""A Responses API stream (`stream: true`): OpenAI's typed events, `sequence_number` from 0,
from `response.created` to `response.completed` (or `.incomplete`, `.failed`).

Free text streams as it comes: one message's `output_text.delta`s; with --reasoning-parser
the thinking first, as a `reasoning` item's `reasoning_text.delta`s, closed when the answer
begins (split as the finished response splits the whole text). Tool calls are parsed whole, so
their items (and a reasoning model's, with logprobs asked: those belong to the whole output)
come at the end, each with its text or arguments in one delta.
"""

from __future__ import annotations

import json
from typing import Any

from eagleserve.messages import TokenOutput
from eagleserve.server.choices import ChoiceState
from eagleserve.server.reasoning import ReasoningStream
from eagleserve.server.response_store import ResponseStore
from eagleserve.server.responses_protocol import (
    FunctionCall,
    Item,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
)
from eagleserve.server.responses_run import ResponseRun
from eagleserve.server.serving import ApiError


class ResponseStream:
    """The events of one response's stream, made as its outputs arrive."""

    def __init__(self, run: ResponseRun) -> None:
        self.run = run
        self.sequence = 0
        call = run.call
        self.live = call.streams_text and (call.reasoning is None or not call.body.logprobs)
        self.split = ReasoningStream(call.reasoning) if self.live and call.reasoning else None
        self.thought = ""  # the thinking streamed so far
        # The ids of the items streamed live, and of those whose done events went out.
        self.opened: list[str] = []
        self.closed: set[str] = set()

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event, numbered in the stream's order (and kept in the run's log
        where it has one: server/background.py)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        event = f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
        if self.run.log is not None:
            self.run.log.append(event)
        return event

    def prelude(self) -> list[str]:
        run = self.run
        created = run.response(run.status).model_dump()
        events = [self.event("response.created", response=created)]
        if run.background:  # in progress at its first output (`delta`)
            return [*events, self.event("response.queued", response=created)]
        return [*events, *self.started()]

    def started(self) -> list[str]:
        self.run.status = "in_progress"
        now = self.run.response("in_progress").model_dump()
        events = [self.event("response.in_progress", response=now)]
        if self.live and self.split is None:  # a message, from its first token
            events += self.message_start()
        return events

    def added(self, item: Item) -> str:
        """An item's output_item.added (as it starts: in progress, empty)."""
        self.opened.append(item.id)
        started = item.model_copy(update={"status": "in_progress"})
        if isinstance(started, FunctionCall):
            started.arguments = ""
        else:
            started.content = []
        index = len(self.opened) - 1
        return self.event("response.output_item.added", output_index=index,
                          item=started.model_dump())  # fmt: skip

    def message_start(self) -> list[str]:
        message = OutputMessage(id=self.run.message_id, status="in_progress", content=[])
        part = OutputText(text="").model_dump(exclude_none=True)
        return [self.added(message), self.event("response.content_part.added", part=part,
                                                **self.at(message.id))]  # fmt: skip

    def at(self, item_id: str) -> dict[str, Any]:
        return {"item_id": item_id, "output_index": self.opened.index(item_id), "content_index": 0}

    def delta(self, c: ChoiceState, text: str, out: TokenOutput) -> str | None:
        events = self.started() if self.run.status == "queued" else []
        if self.live and self.split is None:
            lp = self.run.logprobs(only_new=True)
            if text or lp:
                lps = [e.model_dump() for e in lp or []]
                events.append(self.event("response.output_text.delta", delta=text, logprobs=lps,
                                         **self.at(self.run.message_id)))  # fmt: skip
        elif self.split is not None:
            thinking, answer = self.split.feed(text)
            if c.finished:
                rest = self.split.flush()
                thinking, answer = thinking + rest[0], answer + rest[1]
            events += self.thinking(thinking) + self.answer(answer)
        return "".join(events) or None

    def thinking(self, text: str) -> list[str]:
        if not (text and self.run.call.body.include_reasoning):
            return []
        rid = self.run.reasoning_id
        events = []
        if rid not in self.opened:
            events.append(self.added(ReasoningItem(id=rid, content=[], status="in_progress")))
        self.thought += text
        return [*events, self.event("response.reasoning_text.delta", delta=text, **self.at(rid))]

    def answer(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        rid = self.run.reasoning_id
        if rid in self.opened and rid not in self.closed:  # the thinking ended: whole now
            thought = ReasoningItem(id=rid, content=[ReasoningText(text=self.thought)],
                                    status="completed")  # fmt: skip
            events += self.item_done(thought)
        if self.run.message_id not in self.opened:
            events += self.message_start()
        return [*events, self.event("response.output_text.delta", delta=text, logprobs=[],
                                    **self.at(self.run.message_id))]  # fmt: skip

    def item_done(self, item: Item) -> list[str]:
        """An item's events after its deltas: its text or arguments whole, then the item."""
        self.closed.add(item.id)
        at = self.at(item.id)
        if isinstance(item, FunctionCall):
            del at["content_index"]
            events = [self.event("response.function_call_arguments.done",
                                 arguments=item.arguments, **at)]  # fmt: skip
        elif isinstance(item, ReasoningItem):
            text = item.content[0].text
            events = [self.event("response.reasoning_text.done", text=text, **at)]
        else:
            part = item.content[0]
            lps = [e.model_dump() for e in part.logprobs or []]
            events = [
                self.event("response.output_text.done", text=part.text, logprobs=lps, **at),
                self.event("response.content_part.done",
                           part=part.model_dump(exclude_none=True), **at),
            ]  # fmt: skip
        del at["item_id"]
        at.pop("content_index", None)
        return [*events, self.event("response.output_item.done", item=item.model_dump(), **at)]

    def whole_item(self, item: Item) -> list[str]:
        """An item that did not stream: added, its text or arguments in one delta, done."""
        events = [self.added(item)]
        at = self.at(item.id)
        if isinstance(item, FunctionCall):
            del at["content_index"]
            events.append(self.event("response.function_call_arguments.delta",
                                     delta=item.arguments, **at))  # fmt: skip
        elif isinstance(item, ReasoningItem):
            events.append(self.event("response.reasoning_text.delta",
                                     delta=item.content[0].text, **at))  # fmt: skip
        else:
            part = item.content[0]
            empty = OutputText(text="").model_dump(exclude_none=True)
            events.append(self.event("response.content_part.added", part=empty, **at))
            if part.text:
                lps = [e.model_dump() for e in part.logprobs or []]
                events.append(self.event("response.output_text.delta", delta=part.text,
                                         logprobs=lps, **at))  # fmt: skip
        return [*events, *self.item_done(item)]

    def epilogue(self, store: ResponseStore) -> list[str]:
        run = self.run
        resp = run.finished()
        events = []
        for item in resp.output:
            if item.id in self.closed:
                continue
            events += self.item_done(item) if item.id in self.opened else self.whole_item(item)
        if not run.background:  # one is stored as it changes (server/background.py)
            run.store_into(store)
        # A cancelled response (/abort_request) ends as an incomplete one does: no answer whole.
        kind = "response.completed" if resp.status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=resp.model_dump())]

    def failure(self, err: ApiError) -> list[str]:
        self.run.fail(err)
        failed = self.run.response("failed", error=err).model_dump()
        return [self.event("response.failed", response=failed)]
