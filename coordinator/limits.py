"""What one client connection may cost: the pure rules (no I/O, no asyncio).

Each connection carries a ``ConnectionLimits`` built from ``Settings``:

- **Event rate.** A token bucket (``max_events_per_s``, ``event_burst``): every
  client event takes one token; an event that finds none is refused with
  ``rate_limited`` and the connection goes on.
- **Input budget.** Every event costs ``max(payload bytes, min_event_cost_bytes)``
  against ``max_pending_input_bytes``: its input waits in the budget, tagged
  with the session-log seq it follows, until the session's first stages have
  applied that seq. An event that would overflow it is refused with
  ``input_backpressure``, except the control events (cancel, barge-in, clearing
  the output): they are counted but never refused, since a cancel must never
  wait behind input.
- **Error journaling.** Another token bucket (``journaled_error_burst``,
  ``journaled_errors_per_s``): an error that finds a token is journaled (a
  resume replays it); one that does not goes to the socket only, so a client
  sending invalid events cannot make the coordinator write without bound.

The shell (``coordinator.connection``) reads the clock and the stages'
progress and carries out what these decide.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from schemas.config import Settings
from schemas.realtime import (
    AudioAppend,
    BargeIn,
    ClientEvent,
    FunctionCallOutputItem,
    ItemCreate,
    OutputAudioClear,
    ResponseCancel,
    VideoAppend,
)

CONTROL_EVENTS = (ResponseCancel, BargeIn, OutputAudioClear)
"""Events the input budget counts but never refuses (control before data)."""


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved; starts full."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.at = now

    def take(self, now: float) -> bool:
        """Take one token at time ``now`` (seconds); False when there is none."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = max(self.at, now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class InputBudget:
    """Input bytes accepted from one connection and not yet applied by the first
    stages, each charge tagged with the session-log seq it follows."""

    def __init__(self, limit: int, min_cost: int) -> None:
        self.limit = limit
        self.min_cost = min_cost
        self.pending = 0
        self._charges: deque[tuple[int, int]] = deque()

    def cost(self, event: ClientEvent) -> int:
        return max(self.min_cost, input_bytes(event))

    def fits(self, cost: int) -> bool:
        return self.pending + cost <= self.limit

    def release(self, applied_seq: int) -> None:
        """The first stages applied every log entry up to ``applied_seq``."""
        while self._charges and self._charges[0][0] <= applied_seq:
            self.pending -= self._charges.popleft()[1]

    def charge(self, seq: int, cost: int) -> None:
        """An event was taken; it is done once the log entry ``seq`` is applied."""
        self._charges.append((seq, cost))
        self.pending += cost


def input_bytes(event: ClientEvent) -> int:
    """The input bytes an event carries (decoded size of base64 data), 0 for none."""
    if isinstance(event, AudioAppend):
        return _decoded_size(event.audio)
    if isinstance(event, VideoAppend):
        return _decoded_size(event.image)
    if isinstance(event, ItemCreate):
        item = event.item
        if isinstance(item, FunctionCallOutputItem):
            return len(item.output.encode())
        return sum(len(part.text.encode()) for part in item.content)
    return 0


def _decoded_size(data: str) -> int:
    return len(data) * 3 // 4 - data[-2:].count("=") if data else 0


class ConnectionLimits:
    """The rate, budget and error-journaling state of one connection."""

    def __init__(self, settings: Settings, clock: Callable[[], float]) -> None:
        self.clock = clock
        now = clock()
        self.events = TokenBucket(settings.max_events_per_s, settings.event_burst, now)
        self.errors = TokenBucket(
            settings.journaled_errors_per_s, settings.journaled_error_burst, now
        )
        self.budget = InputBudget(settings.max_pending_input_bytes, settings.min_event_cost_bytes)

    def take_event(self) -> bool:
        """Whether the connection may send one more event now."""
        return self.events.take(self.clock())

    def journal_error(self) -> bool:
        """Whether the next error is journaled (True) or goes to the socket only."""
        return self.errors.take(self.clock())
