"""One response's output item and content parts, framed as the Realtime API frames them.

A response of a duplexq pipeline is an assistant message and, when the model
calls functions, one ``function_call`` item per call, each at the next output
index in the order they came. The message's content parts open on their first
delta, in the order they appear: a ``text``
part (``response.output_text.*``) and an ``audio`` part that carries both the
audio and its transcript (``response.output_audio.*`` and
``response.output_audio_transcript.*``), as the reference API does. When the
response ends, however it ends, every open part is closed with its done events
and the whole text or transcript, then the item, then ``response.done`` lists
the item. Pure and deterministic: the translator replays a journal through
fresh frames on a resume (``coordinator.realtime``).
"""

from __future__ import annotations

from typing import Any

from schemas.items import item_id_for

ServerEvent = dict[str, Any]

CANCEL_REASONS = {"barge_in": "turn_detected"}
"""duplexq's cancel reasons as the reference API names them (default:
``client_cancelled``: the client asked)."""


class Timeline:
    """Where each piece of a response's spoken transcript begins in its audio: what a
    listener who stopped at some millisecond heard (``conversation.item.truncate``)."""

    __slots__ = ("audio_ms", "pieces")

    def __init__(self) -> None:
        self.pieces: list[tuple[float, str]] = []
        self.audio_ms = 0.0

    def said(self, text: str) -> None:
        self.pieces.append((self.audio_ms, text))

    def played(self, ms: float) -> None:
        self.audio_ms += ms

    def heard(self, end_ms: float) -> str:
        """The transcript up to ``end_ms`` of audio: whole pieces, then the words of
        the piece playing then, in proportion to how much of its audio was played."""
        heard: list[str] = []
        for index, (start, text) in enumerate(self.pieces):
            if start >= end_ms:
                break
            stop = self.pieces[index + 1][0] if index + 1 < len(self.pieces) else self.audio_ms
            if end_ms >= stop or stop <= start:
                heard.append(text.strip())
                continue
            cut = text[: round(len(text) * (end_ms - start) / (stop - start))]
            if cut != text:  # whole words only
                cut = cut[: cut.rfind(" ")] if " " in cut else ""
            heard.append(cut.strip())
            break
        return " ".join(piece for piece in heard if piece)


class _Part:
    __slots__ = ("audio", "index", "kind", "text", "transcript")

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index
        self.text = ""
        self.transcript = ""
        self.audio = False

    def standard(self) -> dict[str, Any]:
        """The part as ``response.content_part.*`` carries it."""
        if self.kind == "text":
            return {"type": "text", "text": self.text}
        return {"type": "audio", "transcript": self.transcript}

    def content(self) -> dict[str, Any]:
        """The part as the message item's content lists it."""
        if self.kind == "text":
            return {"type": "output_text", "text": self.text}
        return {"type": "output_audio", "transcript": self.transcript}


class ResponseFrame:
    """The message item of one streaming response and its content parts."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.item_id = item_id_for(response_id)
        self._parts: dict[str, _Part] = {}
        self.timeline = Timeline()
        self._outputs = 0
        """Output items opened so far (the next one's ``output_index``)."""
        self._message_index = 0
        self._calls: list[tuple[int, dict[str, Any]]] = []
        """Function call items, with their output index."""

    def _ids(self, part: _Part | None = None) -> ServerEvent:
        ids: ServerEvent = {"response_id": self.response_id, "item_id": self.item_id,
                            "output_index": self._message_index}  # fmt: skip
        if part is not None:
            ids["content_index"] = part.index
        return ids

    def _item(self, status: str) -> dict[str, Any]:
        return {"id": self.item_id, "object": "realtime.item", "type": "message",
                "role": "assistant", "status": status,
                "content": [p.content() for p in self._parts.values()]}  # fmt: skip

    def _part(self, kind: str) -> tuple[_Part, list[ServerEvent]]:
        events: list[ServerEvent] = []
        if not self._parts:
            self._message_index, self._outputs = self._outputs, self._outputs + 1
            item = self._item("in_progress")
            events.append({"type": "response.output_item.added", "response_id": self.response_id,
                           "output_index": self._message_index, "item": item})  # fmt: skip
            events.append({"type": "conversation.item.added", "item": item})
        part = self._parts.get(kind)
        if part is None:
            part = self._parts[kind] = _Part(kind, len(self._parts))
            events.append({"type": "response.content_part.added", **self._ids(part),
                           "part": part.standard()})  # fmt: skip
        return part, events

    def text(self, delta: str) -> list[ServerEvent]:
        part, events = self._part("text")
        part.text += delta
        return [*events, {"type": "response.output_text.delta", **self._ids(part), "delta": delta}]

    def transcript(self, delta: str) -> list[ServerEvent]:
        part, events = self._part("audio")
        part.transcript += delta
        self.timeline.said(delta)
        return [*events, {"type": "response.output_audio_transcript.delta", **self._ids(part),
                          "delta": delta}]  # fmt: skip

    def audio(self, delta_b64: str, ms: float) -> list[ServerEvent]:
        """An audio delta of ``ms`` milliseconds."""
        part, events = self._part("audio")
        part.audio = True
        self.timeline.played(ms)
        return [*events, {"type": "response.output_audio.delta", **self._ids(part),
                          "delta": delta_b64}]  # fmt: skip

    def function_call(self, call_id: str, name: str, arguments: str) -> list[ServerEvent]:
        """One whole function call: its item added, its arguments, its item done."""
        index, self._outputs = self._outputs, self._outputs + 1
        item_id = f"{self.item_id}_call{index}"
        item: dict[str, Any] = {"id": item_id, "object": "realtime.item",
                                "type": "function_call", "status": "in_progress",
                                "call_id": call_id, "name": name, "arguments": ""}  # fmt: skip
        ids = {"response_id": self.response_id, "item_id": item_id, "output_index": index}
        done = {**item, "status": "completed", "arguments": arguments}
        self._calls.append((index, done))
        return [
            {"type": "response.output_item.added", "response_id": self.response_id,
             "output_index": index, "item": item},
            {"type": "conversation.item.added", "item": item},
            {"type": "response.function_call_arguments.delta", **ids, "call_id": call_id,
             "delta": arguments},
            {"type": "response.function_call_arguments.done", **ids, "call_id": call_id,
             "name": name, "arguments": arguments},
            {"type": "response.output_item.done", "response_id": self.response_id,
             "output_index": index, "item": done},
            {"type": "conversation.item.done", "item": done},
        ]  # fmt: skip

    def end(
        self, status: str, reason: str = "", error: dict[str, Any] | None = None
    ) -> list[ServerEvent]:
        """Close every part and the item, then ``response.done`` with ``status`` (and, for
        a failed response, the ``error`` that failed it)."""
        events: list[ServerEvent] = []
        for part in self._parts.values():
            ids = self._ids(part)
            if part.kind == "text":
                events.append({"type": "response.output_text.done", **ids, "text": part.text})
            else:
                if part.transcript or not part.audio:
                    events.append({"type": "response.output_audio_transcript.done", **ids,
                                   "transcript": part.transcript})  # fmt: skip
                if part.audio:
                    events.append({"type": "response.output_audio.done", **ids})
            events.append({"type": "response.content_part.done", **ids, "part": part.standard()})
        output: list[tuple[int, dict[str, Any]]] = list(self._calls)
        if self._parts:
            item = self._item("completed" if status == "completed" else "incomplete")
            events.append({"type": "response.output_item.done", "response_id": self.response_id,
                           "output_index": self._message_index, "item": item})  # fmt: skip
            events.append({"type": "conversation.item.done", "item": item})
            output.append((self._message_index, item))
        response: dict[str, Any] = {"id": self.response_id, "object": "realtime.response",
                                    "status": status,
                                    "output": [item for _, item in sorted(output)]}  # fmt: skip
        if status != "completed":
            response["status_details"] = _status_details(status, reason)
        if status == "failed" and error is not None:
            response["status_details"]["error"] = {
                "type": error.get("type"), "code": error.get("code"),
                "message": error.get("message")}  # fmt: skip
        events.append({"type": "response.done", "response": response})
        return events


def created(response_id: str) -> ServerEvent:
    return {
        "type": "response.created",
        "response": {
            "id": response_id,
            "object": "realtime.response",
            "status": "in_progress",
            "output": [],
        },
    }


def _status_details(status: str, reason: str) -> dict[str, Any]:
    """The reference API's status details; duplexq's own reason rides beside them under
    ``duplexq`` (``superseded``: a newer response of the session took over;
    ``session_closed``; the cancel event that ended it)."""
    details: dict[str, Any] = {"type": status}
    if status == "cancelled":
        details["reason"] = CANCEL_REASONS.get(reason, "client_cancelled")
    if reason:
        details["duplexq"] = {"reason": reason}
    return details
