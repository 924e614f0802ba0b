"""What a ``response.create`` does, and what its response carries (pure).

A connection decides each ``response.create`` with ``ResponseRequests``::

    state when it arrives                                   what it does
    ------------------------------------------------------  ---------------------------
    a client commit asked for a response and no input came  CLAIM: that commit's response
      since, and no response.create claimed it yet            is this one (nothing new)
    a response a response.create asked for has not been     REFUSE: error
      seen to end (``ResponseRequests.decide`` says why       conversation_already_has_
      only those)                                             active_response
    otherwise                                               NEW: a commit that asks the
                                                              model to answer from the
                                                              conversation, whatever the
                                                              turn added (``respond``)

A response's own options reach the model stage as a ``next_response``
conversation edit (``options_edit``). The request itself, with what only the
client sees of the response (its ``metadata``, whether it is out of band), is
journaled before its commit as a ``duplexq.response.requested`` notice: the
translator creates the response there unless another one is streaming
(``coordinator.responses``), and
``RequestedResponses`` takes the notice out of the events it frames and applies
it to them: ``metadata`` on
``response.created`` and ``response.done``; an out-of-band response's items
are not announced as conversation items (``conversation.item.added`` /
``.done``), since they are not in the conversation. The notice is in the
journal, so a resume frames the response the same way.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from enum import Enum
from typing import Any

from schemas.events import ConversationPayload
from schemas.items import item_id_for
from schemas.response_params import ResponseParams, chat_message
from schemas.tools import choice_text, tools_text

ServerEvent = dict[str, Any]

REQUESTED = "duplexq.response.requested"
"""The journal notice of a response's client-side options; never sent to a client."""
REQUESTS_KEPT = 256


class Create(Enum):
    CLAIM = "claim"
    REFUSE = "refuse"
    NEW = "new"


class ResponseRequests:
    """A connection's view of the responses its client asked for."""

    def __init__(self) -> None:
        self.claimable = False
        """A client commit's response that no ``response.create`` has claimed yet."""
        self.claimed = ""
        """The id of the latest client commit's response."""
        self.asked_up_to = 0
        """The response_seq of the latest response a ``response.create`` reserved."""

    def committed(self, response: str) -> None:
        """The client committed its input: that commit asked for ``response`` (its id)."""
        self.claimable = True
        self.claimed = response

    def decide(self, *, new_input: bool, ended_up_to: int) -> Create:
        """``new_input``: input arrived since the last commit; ``ended_up_to``: the highest
        response_seq seen to end.

        In progress is a response a ``response.create`` asked for: its commit asks the
        model to answer whatever the turn holds, so it always ends. Others are not
        counted: a client commit's or a server VAD turn's may never come (the asr stage
        heard nothing in the turn), and a stage may stream output before any commit
        (echo answers typed text at once) under a reservation no commit followed (one
        whose commit Redis refused); refusing for those could refuse forever. A
        ``response.create`` during them supersedes them, as a newer turn does."""
        if self.claimable and not new_input:
            self.claimable = False
            return Create.CLAIM
        if self.asked_up_to > ended_up_to:
            return Create.REFUSE
        self.claimable = False
        return Create.NEW

    def asked(self, response_seq: int) -> None:
        self.asked_up_to = max(self.asked_up_to, response_seq)


def options_edit(params: ResponseParams) -> ConversationPayload | None:
    """The edit that gives the model stage this response's own options (None: it has
    none; the session's apply)."""
    chosen: dict[str, str] = {}
    if params.tools is not None:
        chosen["tools"] = tools_text(params.tools) or "[]"
    if params.tool_choice is not None:
        chosen["tool_choice"] = choice_text(params.tool_choice)
    if params.instructions:
        chosen["instructions"] = params.instructions
    if params.out_of_band:
        chosen["conversation"] = "none"
    if params.input is not None:
        chosen["input"] = json.dumps([chat_message(item) for item in params.input])
    return ConversationPayload("next_response", "", text=json.dumps(chosen)) if chosen else None


def requested_notice(params: ResponseParams, response: str) -> ServerEvent:
    """The journal notice that a ``response.create`` asked for ``response``, with what
    the client sees of it."""
    notice: ServerEvent = {"type": REQUESTED, "response_id": response}
    if params.metadata is not None:
        notice["metadata"] = dict(params.metadata)
    if params.out_of_band:
        notice["conversation"] = "none"
    return notice


class RequestedResponses:
    """The requested options of the session's responses, applied as they are framed."""

    def __init__(self) -> None:
        self._requests: OrderedDict[str, ServerEvent] = OrderedDict()
        self._outside: str | None = None
        """The item id of the out-of-band response being framed."""

    def frame(self, events: list[ServerEvent]) -> list[ServerEvent]:
        framed: list[ServerEvent] = []
        for event in events:
            kind = event.get("type")
            if kind == REQUESTED:
                self._requests[str(event.get("response_id"))] = event
                while len(self._requests) > REQUESTS_KEPT:
                    self._requests.popitem(last=False)
                continue
            if kind in ("response.created", "response.done"):
                self._decorate(event)
            elif kind in ("conversation.item.added", "conversation.item.done") and self._hidden(
                event
            ):
                continue
            framed.append(event)
        return framed

    def _decorate(self, event: ServerEvent) -> None:
        response = event["response"]
        request = self._requests.get(str(response.get("id")))
        if event["type"] == "response.created":
            out = request is not None and request.get("conversation") == "none"
            self._outside = item_id_for(str(response["id"])) if out else None
        else:
            self._outside = None
        if request is not None and "metadata" in request:
            response["metadata"] = dict(request["metadata"])

    def _hidden(self, event: ServerEvent) -> bool:
        """An item of the out-of-band response being framed (its message or a call)."""
        outside = self._outside
        item_id = str(event["item"].get("id", ""))
        return outside is not None and (item_id == outside or item_id.startswith(outside + "_"))
