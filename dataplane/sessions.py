"""Session authority core: fence validation and session transitions.

Everything that decides whether a fence is current and how a session moves
from one fence to the next lives in this module. It is synchronous and does
no I/O; the Redis authority (``dataplane.authority``) applies the same rules
server-side and is tested against the same table.

Theory of operation
-------------------
A session's *current fence* only moves forward. A fence ``c`` is acceptable
against the current fence ``f`` unless (checked in this order)::

    reason       mismatch when
    ----------   ------------------------------------------------------
    session      c.session_id != f.session_id
    incarnation  c.incarnation != f.incarnation
    epoch        c.epoch < f.epoch
    turn         c.epoch == f.epoch and c.turn_id < f.turn_id
    response     c.epoch == f.epoch and c.response_seq < f.response_seq

A later epoch wins even with a lower turn or response counter: an
interruption starts a new generation and the counters of the old one no
longer order anything.

The in-process session authority that once applied these rules beside the Redis
one lives with the tests now (``tests/session_model.py``): the upstream runtime's
conformance tests run against it.
"""

from __future__ import annotations

from enum import StrEnum

from schemas.errors import (
    FenceMismatchError,
)
from schemas.events import InputMode
from schemas.fence import Fence, require_fence

ALL_MODES: frozenset[InputMode] = frozenset(InputMode)


class MismatchReason(StrEnum):
    """Why a fence was refused; also the label of the dropped-message counters."""

    SESSION = "session"
    INCARNATION = "incarnation"
    EPOCH = "epoch"
    TURN = "turn"
    RESPONSE = "response"


def fence_mismatch(current: Fence, candidate: Fence) -> MismatchReason | None:
    """The reason ``candidate`` regressed against ``current``, or None if acceptable.

    This is the hot-path form every consumer uses to drop stale messages.
    """
    if candidate.session_id != current.session_id:
        return MismatchReason.SESSION
    if candidate.incarnation != current.incarnation:
        return MismatchReason.INCARNATION
    if candidate.epoch != current.epoch:
        return MismatchReason.EPOCH if candidate.epoch < current.epoch else None
    if candidate.turn_id < current.turn_id:
        return MismatchReason.TURN
    if candidate.response_seq < current.response_seq:
        return MismatchReason.RESPONSE
    return None


def check_fence(current: Fence, candidate: object, argument: str = "fence") -> Fence:
    """Return ``candidate`` if acceptable against ``current``; else raise.

    Raises TypeError when ``candidate`` is not a Fence at all and
    FenceMismatchError when it regressed.
    """
    fence = require_fence(candidate, argument)
    reason = fence_mismatch(current, fence)
    if reason is not None:
        raise FenceMismatchError(reason.value, f"{fence} against current {current}")
    return fence


class FenceView:
    """A consumer's view of one session's fence while it reads a stream in order.

    Outputs are judged against the newest fence the consumer knows of, with one
    refinement: a failover's incarnation counts only from the failover's
    barrier in the stream onwards. Outputs the old owner published before the
    barrier were accepted (the user may already be hearing them), so they are
    delivered; anything of the old incarnation after the barrier is a zombie's.
    An output of a *higher* incarnation than the view's is a newer owner's and
    moves the view forward: the publish script writes a failover's barrier in
    the same atomic step that raises the incarnation, so in stream order such
    an output always follows its barrier.

    A consumer that starts reading in the middle of a stream (a stage's new
    owner after a failover, a client resuming) does not know which incarnation
    was live at its read position; ``resuming`` gives it a view that learns the
    incarnation from the stream and only knows the session's current epoch.

    - ``observe(fence)``: an in-band barrier (cancel, failover, open) read from
      the stream; the view moves to it.
    - ``advance(fence)``: out-of-band news (this process just cancelled, or
      re-read the authority); epochs move at once, incarnations wait for
      their barrier.
    - ``judge(fence)``: the reason to drop an output, or None to deliver it
      (which also moves the view forward to it).
    """

    __slots__ = ("_epoch_floor", "current")

    def __init__(self, current: Fence) -> None:
        self.current = current
        self._epoch_floor = current.epoch

    @classmethod
    def resuming(cls, current: Fence, incarnation: int = 0) -> FenceView:
        """A view for reading a stream from a position whose fence is unknown: the
        epoch floor is ``current``'s, the incarnation starts at ``incarnation``
        (the lowest the stream can hold) and turn and response at zero."""
        return cls(Fence(current.session_id, incarnation, current.epoch))

    def observe(self, fence: Fence) -> None:
        if fence.session_id != self.current.session_id:
            return
        if fence.incarnation > self.current.incarnation or (
            fence.incarnation == self.current.incarnation
            and fence_mismatch(self.current, fence) is None
        ):
            self.current = fence
        self._epoch_floor = max(self._epoch_floor, fence.epoch)

    def advance(self, fence: Fence) -> None:
        if fence.session_id != self.current.session_id:
            return
        self._epoch_floor = max(self._epoch_floor, fence.epoch)
        if (
            fence.incarnation == self.current.incarnation
            and fence_mismatch(self.current, fence) is None
        ):
            self.current = fence

    def raise_epoch_floor(self, epoch: int) -> None:
        """Outputs of epochs below ``epoch`` are stale from now on; nothing else moves
        (an older response of the current epoch may still be owed)."""
        self._epoch_floor = max(self._epoch_floor, epoch)

    def judge(self, fence: Fence) -> MismatchReason | None:
        current = self.current
        if fence.incarnation > current.incarnation and fence.session_id == current.session_id:
            current = current.replace(incarnation=fence.incarnation)
        reason = fence_mismatch(current, fence)
        if reason is None and fence.epoch < self._epoch_floor:
            reason = MismatchReason.EPOCH
        if reason is None:
            self.current = fence
        return reason
