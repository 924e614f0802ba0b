"""A response's life, as the client sees it: every rule in this one table (pure).

A response is *reserved* by the authority when the user's turn ends (a client
commit, or the server VAD's turn end: ``response_seq`` + 1). A response a
``response.create`` asked for is created as soon as that request is taken: its
*request* notice is journaled between the reservation and the commit, before any
output of the response (clients wait for ``response.created`` to match their
request, LiveKit Agents for at most a few seconds, while a model may take longer
to say its first word). Any other response is created by its first output, and so
is a requested one while another response streams: that one goes on until the
requested one's first output supersedes it or its final done ends it. From
then on the journal alone decides, read in order, so that a resume replaying the
journal through a fresh ``ResponseLife`` frames it exactly as the live reader did::

    state       journal item                 next        server events
    ----------  ---------------------------  ----------  ------------------------------
    idle        request of R (R not the one  streaming R created R
                that ended last)
    idle        request of the response      idle        -
                that ended last
    streaming R request of R                 streaming R -
    streaming R request of R' (R' != R)      streaming R - (R' is created by its first
                                                         output, as any other response)
    idle        output of R                  streaming R created R
    idle        final done of R              idle        created R, done R completed
    streaming R output of R                  streaming R -
    streaming R output of R' reserved before streaming R -
                R (a stage that does not
                follow responses answering
                an input from before R)
    streaming R output of R' reserved after  streaming R' done R incomplete (superseded),
                R                                        created R'
    streaming R final done                   idle        done R completed
    streaming R cancel barrier               idle        done R cancelled (its reason)
    streaming R close barrier                idle        done R incomplete (session_closed)
    idle        cancel / close barrier       idle        -
    streaming R failure of R                 idle        done R failed
    idle        failure of R                 idle        created R, done R failed
    streaming R failure of R' (R' != R)      idle        done R incomplete (superseded),
                                                         created R', done R' failed
    idle        failure of the response      idle        -
                that ended last

An output of a response reserved before the one streaming reaches the table only
from a stage that does not follow responses (echo, answering each input as it
comes, under the response reserved when it came); a model stage's is stale and
the output reader drops it. It joins the response streaming rather than
re-creating a response that was superseded.

A *final done* is the ``done`` of a client-facing stage at the end of its chain
(``terminal_stages``); a *failure* is a stage's error output (the backend
failed while answering): the response it belongs to ends ``failed``, so a
client waiting for ``response.done`` gets it; an error under the id of the
response that ended last (an input's error after its answer) ends nothing.
``R`` is the response id, derived from the fence the output was produced under.
Every response that was created ends with exactly one ``response.done``; which
server events frame the pieces of a response (deltas, transcripts) is the
translator's business (``coordinator.realtime``).

What the journal cannot tell a connection is ``TurnState``'s: whether input
waits for a commit, which responses the connection has seen end (or
cancelled), the epoch below which outputs are stale since its cancel, and what
its client's ``response.create`` asked for (``coordinator.response_requests``).
With the session's reserved response it says whether a response is in progress.
``coordinator.turns`` carries out what these rules decide.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

from coordinator.response_requests import Create, ResponseRequests
from schemas.errors import ErrorCode, ProtocolError
from schemas.fence import Fence
from schemas.items import response_seq_of


class Item(Enum):
    """What a journal item is, to a response's life."""

    OUTPUT = "output"
    FINAL_DONE = "final_done"
    CANCEL = "cancel"
    CLOSE = "close"
    FAILURE = "failure"
    REQUEST = "request"


class Ended(NamedTuple):
    """``response.done`` for a response, with its status and reason."""

    response_id: str
    status: str
    reason: str = ""


class Created(NamedTuple):
    """``response.created`` for a response."""

    response_id: str


Change = Created | Ended


class ResponseLife:
    """The response the client is currently receiving, moved by journal items."""

    def __init__(self) -> None:
        self.active: str | None = None
        """The streaming response's id; None when idle."""
        self.ended: str | None = None
        """The id of the response that ended last."""

    def step(self, item: Item, response_id: str | None = None, *, reason: str = "") -> list[Change]:
        """Apply one journal item (``response_id`` for requests, outputs and final
        dones, the cancel's ``reason`` for a cancel); the responses it creates and ends, in the
        order their server events go out."""
        changes = self._step(item, response_id, reason)
        for change in changes:
            if isinstance(change, Ended):
                self.ended = change.response_id
        return changes

    def _step(self, item: Item, response_id: str | None, reason: str) -> list[Change]:
        active = self.active
        if item in (Item.CANCEL, Item.CLOSE):
            self.active = None
            if active is None:
                return []
            if item is Item.CANCEL:
                return [Ended(active, "cancelled", reason)]
            return [Ended(active, "incomplete", "session_closed")]
        if response_id is None:
            raise ValueError(f"a {item.value} belongs to a response")
        if item is Item.FAILURE:
            return self._failure(active, response_id, reason)
        if item is Item.REQUEST and (active is not None or response_id == self.ended):
            return []  # another streams (the asked one's output will tell), or it ended
        if item is Item.FINAL_DONE:
            self.active = None
            if active is None:
                return [Created(response_id), Ended(response_id, "completed")]
            return [Ended(active, "completed")]
        if active == response_id:
            return []
        if item is Item.OUTPUT and active is not None and _older(response_id, active):
            return []  # it joins the response streaming, never re-creates an older one
        self.active = response_id
        if active is None:
            return [Created(response_id)]
        return [Ended(active, "incomplete", "superseded"), Created(response_id)]

    def _failure(self, active: str | None, response_id: str, reason: str) -> list[Change]:
        self.active = None
        if active == response_id:
            return [Ended(response_id, "failed", reason)]
        if active is None and response_id == self.ended:
            return []  # that response is over: the error alone tells it
        changes: list[Change] = []
        if active is not None:
            changes.append(Ended(active, "incomplete", "superseded"))
        return [*changes, Created(response_id), Ended(response_id, "failed", reason)]


def _older(response_id: str, than: str) -> bool:
    """Whether ``response_id`` was reserved before ``than``."""
    return response_seq_of(response_id) < response_seq_of(than)


class TurnState:
    """One connection's part in its session's responses, beyond the journal (pure)."""

    def __init__(self) -> None:
        self.uncommitted = False
        """Input arrived since the last commit or clear."""
        self.min_epoch = 0
        """The epoch this connection's latest cancel moved the session to: outputs of an
        older epoch are stale."""
        self.ended_up_to = 0
        """The highest response_seq whose response this connection has seen end (or has
        cancelled): with the session's reserved one, whether a response is in progress."""
        self.requests = ResponseRequests()
        """What ``response.create`` does now."""

    def took_input(self) -> None:
        self.uncommitted = True

    def cleared(self) -> None:
        """The client cleared its input buffer: nothing waits for a commit."""
        self.uncommitted = False

    def committed(self) -> None:
        self.uncommitted = False

    def resumed(self) -> None:
        """Input sent on the old socket may wait for its commit: a commit is taken (not
        refused as empty), and a ``response.create`` asks for a new response."""
        self.uncommitted = True

    def cancelled(self, fence: Fence) -> None:
        """This connection's cancel moved the session to ``fence``: what it cancelled has
        ended, and outputs of an older epoch are stale."""
        self.min_epoch = max(self.min_epoch, fence.epoch)
        self.ended_up_to = max(self.ended_up_to, fence.response_seq)

    def sent(self, server_event: dict[str, Any]) -> None:
        """A server event went to the client; a ``response.done`` ends the response its
        fence names (and those before it)."""
        if server_event["type"] == "response.done":  # "duplexq": ``realtime.EXTENSION``
            ended = int(server_event["duplexq"]["fence"]["response_seq"])
            self.ended_up_to = max(self.ended_up_to, ended)

    def unended(self, reserved: int) -> bool:
        """Whether the session's reserved response (a commit's, the server VAD's turn end)
        has not been seen to end. A resumed connection has seen no end yet, so it counts
        every reserved response as in progress: it never refuses a cancel wrongly."""
        return reserved > self.ended_up_to

    def check_commit(self) -> None:
        """A client commit with no input since the last commit or clear is refused."""
        if not self.uncommitted:
            raise ProtocolError(
                ErrorCode.INPUT_AUDIO_BUFFER_COMMIT_EMPTY,
                "the input audio buffer is empty: nothing was appended since the last "
                "commit or clear",
            )

    def create(self) -> Create:
        """What a ``response.create`` does now (``ResponseRequests.decide``): CLAIM or NEW;
        refused while a response another one asked for is in progress."""
        decision = self.requests.decide(new_input=self.uncommitted, ended_up_to=self.ended_up_to)
        if decision is Create.REFUSE:
            raise ProtocolError(
                ErrorCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE,
                "Conversation already has an active response in progress; wait for its "
                "response.done or cancel it first",
            )
        return decision
