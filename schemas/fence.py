"""The fence: the identity every input and output carries.

``Fence(session_id, incarnation, epoch, turn_id, response_seq)`` names the
generation of session state a message belongs to. Consumers compare a
message's fence with the session's current one and drop what has regressed;
the comparison rule lives in ``dataplane.sessions``.

The struct is frozen (hashable), slotted (no ``__dict__``) and encodes as a
five-element array, so a fence costs a few bytes on the wire.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_SESSION_ID_BYTES = 128


class Fence(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Immutable generation marker of one session's runtime state."""

    session_id: str
    incarnation: int = 0
    epoch: int = 0
    turn_id: int = 0
    response_seq: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not self.session_id:
            raise ValueError("Fence.session_id must be a non-empty string")
        if len(self.session_id.encode()) > MAX_SESSION_ID_BYTES:
            raise ValueError(f"Fence.session_id is longer than {MAX_SESSION_ID_BYTES} bytes")
        for name in ("incarnation", "epoch", "turn_id", "response_seq"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"Fence.{name} must be a non-negative int, got {value!r}")

    def replace(self, **changes: Any) -> Fence:
        """A copy with some fields changed (validated like a new fence)."""
        return msgspec.structs.replace(self, **changes)

    def next_incarnation(self) -> Fence:
        """The first fence of the session's next life (reopen or failover)."""
        return Fence(self.session_id, self.incarnation + 1, 0, 0, 0)

    def next_epoch(self) -> Fence:
        """The fence after an interruption: same turn and response counters."""
        return self.replace(epoch=self.epoch + 1)

    def next_turn(self) -> Fence:
        return self.replace(turn_id=self.turn_id + 1)

    def next_response(self) -> Fence:
        return self.replace(response_seq=self.response_seq + 1)

    def __str__(self) -> str:
        return (
            f"{self.session_id}/i{self.incarnation}/e{self.epoch}"
            f"/t{self.turn_id}/r{self.response_seq}"
        )


def require_fence(value: object, argument: str = "fence") -> Fence:
    """Return ``value`` if it is a Fence, else raise TypeError naming the type.

    Session paths call this first so a plain session id passed by mistake
    fails loudly instead of comparing unequal forever.
    """
    if not isinstance(value, Fence):
        raise TypeError(f"{argument} must be a Fence, not {type(value).__name__}")
    return value
