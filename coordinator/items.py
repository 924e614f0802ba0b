"""The conversation's items as a connection knows them, from the journal (pure).

``ConversationItems`` follows the server events a translator frames
(``coordinator.realtime``): an item the client created
(``conversation.item.created``), a response's message or function call
(``conversation.item.added`` / ``.done``), the user's audio
(``input_audio_buffer.committed``, then its transcript), and forgets a deleted
one. Replaying the same journal gives the same items, so a resumed connection
knows them too. ``conversation.item.delete`` and ``.retrieve`` of an id it does
not know are refused with the reference API's codes.

A client-created item is announced as the reference API announces it,
``conversation.item.added`` then ``conversation.item.done``, beside the beta
``conversation.item.created`` older clients wait for (``announced``): the three
come from one journal entry.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

ServerEvent = dict[str, Any]

ITEMS_KEPT = 1024
"""Items a connection remembers (the oldest are forgotten first)."""


def announced(events: list[ServerEvent]) -> list[ServerEvent]:
    """Each ``conversation.item.created`` followed by its ``added`` and ``done``."""
    out: list[ServerEvent] = []
    for event in events:
        out.append(event)
        if event.get("type") == "conversation.item.created":
            item = event["item"]
            out.append({"type": "conversation.item.added", "item": dict(item)})
            out.append({"type": "conversation.item.done", "item": dict(item)})
    return out


class ConversationItems:
    """Item id -> the item, as the latest server event about it showed it."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def get(self, item_id: str) -> dict[str, Any] | None:
        return self._items.get(item_id)

    def add(self, item: dict[str, Any]) -> None:
        """An item this connection has just created (known before its notice returns)."""
        self._items[str(item["id"])] = dict(item)
        while len(self._items) > ITEMS_KEPT:
            self._items.popitem(last=False)

    def observe(self, event: ServerEvent) -> None:
        kind = event.get("type")
        if kind in ("conversation.item.created", "conversation.item.added",
                    "conversation.item.done"):  # fmt: skip
            self.add(event["item"])
        elif kind == "conversation.item.deleted":
            self._items.pop(str(event.get("item_id")), None)
        elif kind == "input_audio_buffer.committed":
            item_id = str(event.get("item_id"))
            if item_id not in self._items:
                self.add(_user_audio(item_id))
        elif kind == "conversation.item.input_audio_transcription.completed":
            item = self._items.get(str(event.get("item_id")))
            if item is not None and item.get("type") == "message":
                item["content"] = [{"type": "input_audio", "transcript": event.get("transcript")}]


def _user_audio(item_id: str) -> dict[str, Any]:
    content = [{"type": "input_audio", "transcript": None}]
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user",
            "status": "completed", "content": content}  # fmt: skip
