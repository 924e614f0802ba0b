"""The client's edits of the model's conversation, as session-log inputs.

``conversation.item.create`` with role ``assistant`` or ``system``,
``conversation.item.delete`` and ``conversation.item.truncate`` (and duplexq's
``duplexq.playback.ack``, the same cut named by response) become one
``EDIT_CONVERSATION`` input each. The runtime passes it down the chain to the
model stage, whose history then holds exactly what the client says the
conversation is (``workers.backends.vllm_history``).

Truncation is what the user heard: the coordinator knows, from the response's
journal, where each spoken sentence begins in the audio (``frames.Timeline``),
so ``audio_end_ms`` becomes the text heard up to there, and the model's
assistant message is cut to it. An item is named as ``schemas.items`` names
it; deleting one the conversation does not hold changes nothing.
"""

from __future__ import annotations

import secrets
from typing import Any

from coordinator.realtime import ServerEventTranslator
from schemas.errors import ErrorCode, ProtocolError
from schemas.events import ConversationPayload
from schemas.items import item_id_for
from schemas.realtime import (
    FunctionCallOutputItem,
    ItemCreate,
    ItemDelete,
    ItemTruncate,
    MessageItem,
    PlaybackAck,
)

Notice = dict[str, Any]


def text_of(item: MessageItem) -> str:
    return "".join(part.text for part in item.content)


def added(event: ItemCreate) -> tuple[ConversationPayload, Notice]:
    """An assistant or system message, or a function's result, for the conversation, and
    its announcement."""
    item = event.item
    item_id = item.id or f"item_{secrets.token_hex(8)}"
    if isinstance(item, FunctionCallOutputItem):
        edit = ConversationPayload("add", item_id, role="tool", text=item.output,
                                   call_id=item.call_id)  # fmt: skip
    else:
        edit = ConversationPayload("add", item_id, role=item.role, text=text_of(item))
    return edit, created_notice(event, item_id)


def created_notice(event: ItemCreate, item_id: str) -> Notice:
    item = {**event.item.model_dump(mode="json", exclude_none=True), "id": item_id,
            "object": "realtime.item", "status": "completed"}  # fmt: skip
    return {"type": "conversation.item.created", "item": item}


def check_output(
    item: FunctionCallOutputItem,
    translator: ServerEventTranslator,
    min_epoch: int,
    refused: set[str],
) -> None:
    """Refuse, once, a function's result for a call whose response was interrupted after
    it (a barge-in or cancel moved the session on): the model is not asked about it
    under the new epoch unless the client sends it again. A call this connection has
    not seen (made before a resume) is taken as it comes."""
    epoch = translator.calls.get(item.call_id)
    current = max(min_epoch, translator.epoch)
    if epoch is None or epoch >= current or item.call_id in refused:
        return
    refused.add(item.call_id)
    raise ProtocolError(
        ErrorCode.FUNCTION_CALL_STALE,
        f"call {item.call_id!r} belongs to a response interrupted since; send the result "
        "again to give it to the model anyway",
    )


def deleted(event: ItemDelete) -> tuple[ConversationPayload, Notice]:
    edit = ConversationPayload("delete", event.item_id)
    return edit, {"type": "conversation.item.deleted", "item_id": event.item_id}


def truncated(
    event: ItemTruncate, translator: ServerEventTranslator
) -> tuple[ConversationPayload, Notice]:
    """The assistant item cut to what was heard in its first ``audio_end_ms``."""
    timeline = translator.timeline(event.item_id)
    if timeline is None or not timeline.audio_ms:
        raise ProtocolError(
            ErrorCode.ITEM_NOT_FOUND,
            f"no spoken response item {event.item_id!r} is known to this connection",
        )
    if event.audio_end_ms > timeline.audio_ms + 1:
        raise ProtocolError(
            ErrorCode.INVALID_EVENT,
            f"audio_end_ms {event.audio_end_ms} is beyond the item's "
            f"{int(timeline.audio_ms)} ms of audio",
        )
    edit = ConversationPayload("truncate", event.item_id, text=timeline.heard(event.audio_end_ms))
    notice = {"type": "conversation.item.truncated", "item_id": event.item_id,
              "content_index": event.content_index, "audio_end_ms": event.audio_end_ms}  # fmt: skip
    return edit, notice


def acknowledged(
    event: PlaybackAck, translator: ServerEventTranslator
) -> ConversationPayload | None:
    """The cut a ``duplexq.playback.ack`` makes: the response's item, to what was heard (None
    when this connection knows nothing spoken of it)."""
    item_id = item_id_for(event.response_id)
    timeline = translator.timeline(item_id)
    if timeline is None or not timeline.audio_ms:
        return None
    played = min(float(event.played_ms), timeline.audio_ms)
    return ConversationPayload("truncate", item_id, text=timeline.heard(played))
