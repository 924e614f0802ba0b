"""What a nemesis client records: one history of operations per client (pure data).

An answer to one attempt at an input is four *blocks*, each a fixed-width text
``<cc.kkkk.a.j>`` (client, input number, attempt, position 0..3): the echo
talker splits the input's text into four equal deltas, so every delivered
delta names exactly what it is. A client sends its inputs one at a time; an
attempt is re-sent (attempt + 1) only when the socket died before the server
acknowledged it (``conversation.item.created``), so an unacknowledged attempt
is Jepsen's *info*: it may or may not have been accepted, and either outcome
is fine, but never twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

BLOCKS = 4
"""Blocks per answer (the talker's ``chunks``)."""
_BLOCK = re.compile(r"<(\d{2})\.(\d{4})\.(\d)\.(\d)>")


class Attempt(NamedTuple):
    """One attempt at one input of one client."""

    client: int
    input: int
    attempt: int

    def text(self) -> str:
        """The input's text: the answer's four blocks, concatenated."""
        return "".join(
            f"<{self.client:02d}.{self.input:04d}.{self.attempt}.{j}>" for j in range(BLOCKS)
        )


class Block(NamedTuple):
    attempt: Attempt
    position: int


def parse_blocks(delta: str) -> tuple[list[Block], bool]:
    """The blocks in one delta, and whether the delta held anything else."""
    blocks = [
        Block(Attempt(int(c), int(k), int(a)), int(j)) for c, k, a, j in _BLOCK.findall(delta)
    ]
    garbled = len(_BLOCK.sub("", delta)) > 0
    return blocks, garbled


Kind = Literal[
    "send", "ack", "block", "cancel_sent", "cancelled", "cancel_refused", "drop", "resume",
    "dead", "error", "garbled", "call", "result_sent", "silent",
]  # fmt: skip
"""``cancel_refused``: the server answered a ``response.cancel`` with
``response_cancel_not_active`` (the answer had ended already). ``silent``: the
client gave its socket up after a ping went unanswered. ``call``: the model
called the client's function for an attempt (``detail``: the call's id);
``result_sent``: the client answered it."""


@dataclass(frozen=True, slots=True)
class Op:
    """One thing a client did or saw, at time ``t`` (seconds since the run began)."""

    kind: Kind
    t: float
    attempt: Attempt | None = None
    block: int = -1
    epoch: int = -1
    detail: str = ""


@dataclass(slots=True)
class History:
    """Every operation of one client, in the order the client saw them."""

    client: int
    ops: list[Op] = field(default_factory=list)

    def add(self, op: Op) -> None:
        self.ops.append(op)
