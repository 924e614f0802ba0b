"""Time to first output: from the end of the user's turn to its answer's first output.

A pure state machine the connection feeds with each server event it sends (no I/O).
A turn ends at the client's commit (a typed message's ``response.create``, or
``input_audio_buffer.commit``) or when the server VAD's turn end reaches the
coordinator (an ``input_audio_buffer.committed`` a stage produced). The answer is
the first response created after that; its first output is its first delta or
duplex decision (``duplexq.response.speak``/``listen``) sent to the client. A
response that ends with no output (cancelled, failed) measures nothing.
"""

from __future__ import annotations

from typing import Any

COMMIT = "commit"
SERVER_VAD = "server_vad"

FIRST_OUTPUTS = frozenset({
    "response.output_text.delta", "response.output_audio.delta",
    "response.output_audio_transcript.delta", "response.function_call_arguments.delta",
    "duplexq.response.speak", "duplexq.response.listen",
})  # fmt: skip
"""Server events that carry an answer's output."""


class TurnClock:
    """The turn being waited on, if any, and how its wait ends."""

    def __init__(self) -> None:
        self.ended: float | None = None
        """When the turn ended (``time.monotonic()``); None: no turn waits for output."""
        self.kind = COMMIT
        """How it ended: ``commit`` or ``server_vad`` (the metric's ``turn`` label)."""
        self.answering = False
        """Whether the turn's answer has been created."""

    def committed(self, now: float) -> None:
        """The client's commit ended the user's turn."""
        self.ended, self.kind, self.answering = now, COMMIT, False

    def forget(self) -> None:
        """The commit was refused: no turn waits."""
        self.ended = None

    def sent(self, event: dict[str, Any], now: float) -> tuple[str, float] | None:
        """Note one server event sent to the client; ``(kind, seconds)`` when it is the
        first output of the answer to the turn that ended last."""
        kind = event["type"]
        if kind == "input_audio_buffer.committed" and event.get("duplexq", {}).get("stage"):
            # The server VAD's turn end (the client's own commit is announced without a
            # stage, and its clock started when the commit was accepted).
            self.ended, self.kind, self.answering = now, SERVER_VAD, False
            return None
        if self.ended is None:
            return None
        if kind == "response.created":
            self.answering = True
        elif self.answering and kind in FIRST_OUTPUTS:
            measured = (self.kind, now - self.ended)
            self.ended = None
            return measured
        elif self.answering and kind == "response.done":
            self.ended = None
        return None
