"""The client events that ask for a response or about an item, for a connection.

- ``response.create`` and ``input_audio_buffer.commit``: parsed here, decided
  and carried out by the session's ``coordinator.turns.Turns`` (claimed, refused
  or a new response; a commit with nothing appended since the last commit or
  clear is ``input_audio_buffer_commit_empty``);
- ``conversation.item.delete`` / ``.retrieve`` of an item the conversation does
  not hold: ``item_delete_invalid_item_id`` / ``item_retrieve_invalid_item_id``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from coordinator.realtime import invalid_event
from schemas.errors import ErrorCode, ProtocolError
from schemas.realtime import AudioCommit, ItemDelete, ItemRetrieve, ResponseCreate
from schemas.response_params import ResponseParams

if TYPE_CHECKING:
    from coordinator.connection import Connection


async def handle(conn: Connection, event: AudioCommit | ResponseCreate | ItemRetrieve) -> None:
    if isinstance(event, AudioCommit):
        await conn.turns.commit()
    elif isinstance(event, ResponseCreate):
        await conn.turns.create(params_of(event))
    else:
        await retrieve(conn, event)


def params_of(event: ResponseCreate) -> ResponseParams:
    try:
        return ResponseParams.model_validate(event.response or {})
    except ValidationError as exc:
        raise invalid_event(event.type, exc, skip=0, whole="response") from exc


def check_delete(conn: Connection, event: ItemDelete) -> None:
    if conn.translator.items.get(event.item_id) is None:
        raise ProtocolError(
            ErrorCode.ITEM_DELETE_INVALID_ITEM_ID,
            f"Item with item_id not found: {event.item_id}",
        )


async def retrieve(conn: Connection, event: ItemRetrieve) -> None:
    item = conn.translator.items.get(event.item_id)
    if item is None:
        raise ProtocolError(
            ErrorCode.ITEM_RETRIEVE_INVALID_ITEM_ID,
            f"Item with item_id not found: {event.item_id}",
        )
    await conn.turns.journal({"type": "conversation.item.retrieved", "item": item})
