"""The client events that ask for a response or about an item, carried out for a
connection (the shell around ``coordinator.response_requests`` and
``coordinator.items``).

- ``response.create``: claimed by the client commit before it, refused while a
  response another ``response.create`` asked for is in progress, or a new
  response from the conversation (its own options passed down first, its
  client-side options journaled before its commit, so that the response's first
  event finds them);
- ``input_audio_buffer.commit`` with nothing appended since the last commit or
  clear: ``input_audio_buffer_commit_empty``;
- ``conversation.item.delete`` / ``.retrieve`` of an item the conversation does
  not hold: ``item_delete_invalid_item_id`` / ``item_retrieve_invalid_item_id``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from coordinator.realtime import invalid_event
from coordinator.response_requests import Create, options_edit, requested_notice
from schemas.errors import ErrorCode, ProtocolError
from schemas.events import CommitPayload, InputMode
from schemas.items import response_id
from schemas.realtime import AudioCommit, ItemDelete, ItemRetrieve, ResponseCreate
from schemas.response_params import ResponseParams

if TYPE_CHECKING:
    from coordinator.connection import Connection


async def handle(conn: Connection, event: AudioCommit | ResponseCreate | ItemRetrieve) -> None:
    if isinstance(event, AudioCommit):
        await commit(conn)
    elif isinstance(event, ResponseCreate):
        await create(conn, event)
    else:
        await retrieve(conn, event)


def params_of(event: ResponseCreate) -> ResponseParams:
    try:
        return ResponseParams.model_validate(event.response or {})
    except ValidationError as exc:
        raise invalid_event(event.type, exc, skip=0, whole="response") from exc


async def create(conn: Connection, event: ResponseCreate) -> None:
    params = params_of(event)
    decision = conn.requests.decide(new_input=conn.uncommitted, ended_up_to=conn._ended_up_to)
    if decision is Create.REFUSE:
        raise ProtocolError(
            ErrorCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE,
            "Conversation already has an active response in progress; wait for its "
            "response.done or cancel it first",
        )
    if decision is Create.CLAIM:
        # The commit asked already: the request creates its response if it has not
        # begun, and what the client sees of it applies from its next event on.
        await conn._journal(requested_notice(params, conn.requests.claimed))
        return
    await _new_response(conn, params)


async def _new_response(conn: Connection, params: ResponseParams) -> None:
    edit = options_edit(params)
    if edit is not None:
        await conn.coordinator.append(
            conn.session_id, InputMode.EDIT_CONVERSATION, edit, attachment=conn.attachment
        )
    fence, _ = await conn.commit_turn(
        CommitPayload(respond=True), lambda fence: requested_notice(params, response_id(fence))
    )
    conn.requests.asked(fence.response_seq)


async def commit(conn: Connection) -> None:
    """A client commit of its input: refused when there is none."""
    if not conn.uncommitted:
        raise ProtocolError(
            ErrorCode.INPUT_AUDIO_BUFFER_COMMIT_EMPTY,
            "the input audio buffer is empty: nothing was appended since the last commit or clear",
        )
    conn.requests.committed(response_id(await conn._commit()))


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
    await conn._journal({"type": "conversation.item.retrieved", "item": item})
