"""The Responses API's stored responses (`store: true`), for `GET /v1/responses/{id}` and for
`previous_response_id`: in this process's memory, the most recent `capacity` kept.

Each entry holds its whole conversation (the earlier turns, its input and its output, as chat
messages; not its `instructions`, which OpenAI does not carry over), so a later turn needs
only this one entry, however many older ones were evicted. A conversation is at most the
context length in tokens, which bounds an entry (and a streamed background response's events,
kept with it, are a few hundred bytes per token). A background response
(server/background.py) is stored at once and again as its status changes. Replicas
(`--dp-size`) each keep their own: a `previous_response_id` must reach the replica that
answered it (sticky sessions).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from eagleserve.server.protocol import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    conversation: tuple[ChatMessage, ...]  # every turn up to and including its output
    # Its request's `input` as items with ids, in order (GET /v1/responses/{id}/input_items).
    input_items: tuple[dict[str, Any], ...] = ()
    # A streamed background response's events, in order (GET /v1/responses/{id}?stream=true
    # reads them again); None for any other response.
    events: tuple[str, ...] | None = None


def page_of_items(
    items: tuple[dict[str, Any], ...], limit: int, order: str, after: str | None,
    before: str | None,
) -> dict[str, Any] | str:  # fmt: skip
    """OpenAI's list page of `items` (in `order`, asc or desc: oldest or newest first), the
    `limit` after the item `after` and before the item `before`; or which id is not there."""
    ordered = list(items if order == "asc" else reversed(items))
    ids = [item["id"] for item in ordered]
    lo, hi = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            return name
    if after is not None:
        lo = ids.index(after) + 1
    if before is not None:
        hi = ids.index(before)
    data = ordered[lo:hi][:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": hi - lo > limit}  # fmt: skip


class ResponseStore:
    """At most `capacity` responses, the least recently stored or read evicted first (0:
    nothing is stored)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        key = entry.response["id"]
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, key: str) -> StoredResponse | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def delete(self, key: str) -> bool:
        return self._entries.pop(key, None) is not None
