"""The one owner of a response's life in the coordinator, for one connection.

The connection parses a client's events and hands the ones that touch a turn or
a response here: input that waits for a commit, the client's commit, a
``response.create``, a cancel, a function call's result. ``Turns`` decides
with the pure rules of ``coordinator.responses`` (``TurnState``) and carries
them out through the ``Coordinator`` facade, the one commit path
(``Coordinator.commit``) included; the connection's pump tells it what went to
the client (``TurnState.sent``) and drops what its cancel made stale
(``TurnState.min_epoch``). The turn's clock and trace start at its commit here
and are read as its answer is sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from coordinator import conversation
from coordinator.realtime import ServerEventTranslator, spoken_item
from coordinator.response_requests import Create, options_edit, requested_notice
from coordinator.responses import TurnState
from coordinator.service import Coordinator, Notice
from coordinator.turn_clock import TurnClock
from coordinator.turn_trace import TurnTrace
from dataplane.metrics import CANCEL_ACK
from schemas.errors import ErrorCode, ProtocolError
from schemas.events import ClearPayload, CommitPayload, InputMode, Payload
from schemas.fence import Fence
from schemas.items import response_id
from schemas.realtime import FunctionCallOutputItem
from schemas.response_params import ResponseParams
from schemas.trace import new_trace


class Turns:
    """A connection's session's turns and the responses they ask for."""

    def __init__(
        self, coordinator: Coordinator, translator: ServerEventTranslator, attachment: str
    ) -> None:
        self.coordinator = coordinator
        self.translator = translator
        self.attachment = attachment
        """The connection's id in the session's attachment: writes are taken only while
        it serves the session."""
        self.session_id = ""
        self.state = TurnState()
        self.last_seq = 0
        """The session-log seq of this connection's latest append."""
        self.clock = TurnClock()
        self.trace: TurnTrace | None = None
        """Set once the session is known, while tracing is on (``coordinator.turn_trace``)."""
        self._refused: set[str] = set()
        """Function calls whose late result was refused once (a re-send is taken)."""

    # -- input ---------------------------------------------------------------------

    async def take_input(self, mode: InputMode, payload: Payload) -> int:
        """Append one input to the session log; it waits for a commit. Its seq."""
        receipt = await self.coordinator.append(
            self.session_id, mode, payload, attachment=self.attachment
        )
        self.last_seq = receipt.seq
        self.state.took_input()
        return receipt.seq

    async def clear(self) -> None:
        """The client cleared its input buffer: nothing of it waits for a commit."""
        await self.take_input(InputMode.CLEAR_AUDIO, ClearPayload())
        self.state.cleared()
        await self.journal({"type": "input_audio_buffer.cleared"})

    def function_result(self, item: FunctionCallOutputItem) -> None:
        """A function call's result: refused once for a call of a response interrupted
        since (``conversation.check_output``); taken, the next ``response.create`` asks
        the model again."""
        conversation.check_output(item, self.translator, self.state.min_epoch, self._refused)
        self.state.took_input()

    # -- commits and responses -----------------------------------------------------

    async def commit(self) -> None:
        """The client's commit ends the user's turn (refused with no input since the last
        one); its spoken item joins the conversation, and a ``response.create`` may claim
        the response it reserved."""
        self.state.check_commit()
        fence, seq = await self._commit(CommitPayload())
        await self.journal({"type": "input_audio_buffer.committed", "item_id": f"item_{seq}"})
        for event in spoken_item(f"item_{seq}"):
            await self.journal(event)
        self.state.requests.committed(response_id(fence))

    async def create(self, params: ResponseParams) -> None:
        """A ``response.create``: claims the client commit's response, is refused, or asks
        the model for a new response from the conversation (``TurnState.create``)."""
        if self.state.create() is Create.CLAIM:
            # The commit asked already: the request creates its response if it has not
            # begun, and what the client sees of it applies from its next event on.
            await self.journal(requested_notice(params, self.state.requests.claimed))
            return
        edit = options_edit(params)
        if edit is not None:
            await self.coordinator.append(
                self.session_id, InputMode.EDIT_CONVERSATION, edit, attachment=self.attachment
            )
        fence, _ = await self._commit(
            CommitPayload(respond=True), lambda fence: requested_notice(params, response_id(fence))
        )
        self.state.requests.asked(fence.response_seq)

    async def _commit(
        self, payload: CommitPayload, notice: Callable[[Fence], Notice | None] | None = None
    ) -> tuple[Fence, int]:
        """Commit the turn through ``Coordinator.commit`` (``notice`` journaled between
        the reservation and the commit); the reserved fence and the commit's seq."""
        # The turn ends as its commit arrives: the clock starts before the answer (which
        # may come back before the append returns) can be sent.
        self.clock.committed(time.monotonic())
        if self.trace is not None:
            payload = msgspec.structs.replace(payload, trace=new_trace(time.time_ns()))
        try:
            fence, receipt = await self.coordinator.commit(
                self.session_id, payload, attachment=self.attachment, notice=notice
            )
        except BaseException:
            self.clock.forget()
            raise
        self.last_seq = receipt.seq
        self.state.committed()
        return fence, receipt.seq

    async def in_progress(self) -> bool:
        """Whether a response is streaming, or reserved (a commit, the server VAD's turn
        end) and not yet seen to end (``TurnState.unended``)."""
        if self.translator.active is not None:
            return True
        return self.state.unended(await self.coordinator.reserved_response(self.session_id))

    async def cancel(self, reason: str, *, only_active: bool = False) -> str:
        """Interrupt the session (barge-in, ``response.cancel``, an output buffer's clear);
        ``only_active``: refused when no response is in progress. The id of the response
        whose output it cleared: the one streaming, else the one it cancelled."""
        if only_active and not await self.in_progress():
            raise ProtocolError(
                ErrorCode.RESPONSE_CANCEL_NOT_ACTIVE, "no response is in progress to cancel"
            )
        started = time.monotonic()
        active = self.translator.active
        result = await self.coordinator.cancel(
            self.session_id, reason=reason, attachment=self.attachment
        )
        self.state.cancelled(result.fence)
        CANCEL_ACK.observe(time.monotonic() - started)
        return active or response_id(result.cancelled)

    # -- notices -------------------------------------------------------------------

    async def journal(self, event: dict[str, Any], *, receipt: bool = True) -> None:
        """Journal a notice for the client, while this connection serves the session. A
        notice acknowledging what the event wrote (``receipt``) is journaled on a full
        Redis too: refused, it would tell the client that what was taken was not."""
        await self.coordinator.journal(
            self.session_id, event, attachment=self.attachment, receipt=receipt
        )
        if event["type"] == "conversation.item.created":  # known before the pump frames it
            self.translator.items.add(event["item"])
