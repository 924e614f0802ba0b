"""The checker: what must hold, judged from the clients' histories alone (pure).

Per client:

- **lost**: an acknowledged attempt, not cancelled before its answer was
  complete, some of whose four blocks never arrived;
- **stale**: a block or a function call delivered after the client received a
  cancel acknowledgement (``duplexq.response.cancelled``) for a later epoch than its own;
- **duplicated**: a block delivered more than once, or a function call (by its
  id) emitted more than once;
- **out of order**: a block delivered after a block that comes later (a later
  position of the same attempt, or any block of a later attempt);
- **dead**: the session could not go on (a resume refused, the session closed);
- **stalled**: an owed answer that made no progress for longer than
  ``stall_s`` (it may have arrived in the end; a lost one counts as lost).

Recovery of a fault: for every client that was waiting for an owed answer when
the fault struck (or began to within a second), the time until its next block,
or, when the client stalled
(a second or more without progress on an owed answer) beginning within a second
after the fault, until the stall ended (a block already on its way must not
hide the stall that follows it); the fault's recovery is the longest of those.
Reported per fault class (median and max).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from chaos.history import BLOCKS, Attempt, History, Op

COUNTS = ("lost", "stale", "duplicated", "out_of_order", "dead", "stalled")
"""What must be zero."""

RECOVERY_BOUND_S = {
    "drop_socket": 3.0,
    "kill_redis": 8.0,
    "restart_primary": 20.0,
    "promote_replica": 20.0,
    "partition": 20.0,
}
"""The most a fault of a class may take to recover in the CI shape (docs/nemesis.md,
"Bounds"); a class not named here has ``DEFAULT_BOUND_S``. A fault's figure includes any
other fault that was still recovering when it struck or struck while it recovered: such
a fault is judged against the larger of the two classes' bounds (``Verdict.over_bound``).
A bound is a single fault's worst path with room for one overlapping fault of its own
class, not its median."""

DEFAULT_BOUND_S = 15.0


def bound_of(kind: str) -> float:
    """The recovery bound of a fault class (s)."""
    return RECOVERY_BOUND_S.get(kind, DEFAULT_BOUND_S)


def _aimed(fault: Fault) -> str:
    """The client a fault is aimed at ('' for a fault that may reach every client)."""
    return fault.target.removeprefix("client-") if fault.target.startswith("client-") else ""


@dataclass(slots=True)
class ClientResult:
    client: int
    counts: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def note(self, what: str, example: str) -> None:
        self.counts[what] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{what}: {example}")


@dataclass(frozen=True, slots=True)
class Fault:
    t: float
    kind: str
    target: str = ""


@dataclass(slots=True)
class Verdict:
    clients: list[ClientResult]
    struck: list[tuple[Fault, float | None]] = field(default_factory=list)
    """Every fault with its recovery (None: it caught no client waiting)."""

    @property
    def recovery(self) -> dict[str, list[float]]:
        """Fault class -> recovery time (s) of each fault of that class that hit a client."""
        recovery: dict[str, list[float]] = {}
        for fault, took in self.struck:
            if took is not None:
                recovery.setdefault(fault.kind, []).append(took)
        return recovery

    def over_bound(self) -> dict[str, float]:
        """The classes with a fault slower than its bound, with the slowest such
        recovery (s). A fault's bound is its class's, or the largest bound among the
        faults that overlapped its recovery: one still recovering when it struck, or
        one that struck while it recovered (a fault that caught no client waiting
        overlaps only if it struck then)."""
        over: dict[str, float] = {}
        for fault, took in self.struck:
            if took is not None and took > self._bound(fault, took):
                over[fault.kind] = max(over.get(fault.kind, 0.0), round(took, 3))
        return over

    def _bound(self, fault: Fault, took: float) -> float:
        bound = bound_of(fault.kind)
        for other, other_took in self.struck:
            if other.t <= fault.t + took and other.t + (other_took or 0.0) >= fault.t:
                bound = max(bound, bound_of(other.kind))
        return bound

    @property
    def totals(self) -> Counter[str]:
        total: Counter[str] = Counter({name: 0 for name in COUNTS})
        for client in self.clients:
            total.update(client.counts)
        return total

    @property
    def ok(self) -> bool:
        totals = self.totals
        return all(totals[name] == 0 for name in COUNTS)

    def recovery_summary(self) -> dict[str, dict[str, float | int]]:
        summary: dict[str, dict[str, float | int]] = {}
        for kind, times in sorted(self.recovery.items()):
            summary[kind] = {
                "faults": len(times),
                "p50_s": round(statistics.median(times), 3) if times else 0.0,
                "max_s": round(max(times), 3) if times else 0.0,
            }
        return summary


def check(
    histories: Sequence[History], faults: Iterable[Fault] = (), *, stall_s: float = 20.0
) -> Verdict:
    results = [_check_client(h, stall_s) for h in histories]
    return Verdict(results, _recovery(histories, list(faults)))


class _ClientCheck:
    """Walks one client's history in order, noting what must not happen."""

    def __init__(self, history: History) -> None:
        self.result = ClientResult(history.client)
        self.cancel_epoch = -1
        self.seen: Counter[tuple[Attempt, int]] = Counter()
        self.last_block: tuple[Attempt, int] | None = None
        self.acked: set[Attempt] = set()
        self.sent_at: dict[Attempt, float] = {}
        self.cancelled: set[Attempt] = set()
        self.arrivals: dict[Attempt, list[float]] = {}
        self.outstanding: Attempt | None = None
        self.calls: Counter[str] = Counter()

    def op(self, op: Op) -> None:
        if op.kind == "send" and op.attempt is not None:
            self.outstanding = op.attempt
            self.sent_at[op.attempt] = op.t
        elif op.kind == "ack" and op.attempt is not None:
            self.acked.add(op.attempt)
        elif op.kind == "cancelled":
            # A cancel ends everything of the epochs before it: every answer sent so
            # far and not complete (an attempt sent again after a dropped socket, whose
            # first try the server had accepted after all, included).
            self.cancel_epoch = max(self.cancel_epoch, op.epoch)
            for attempt in self.sent_at:
                if len(self.arrivals.get(attempt, ())) < BLOCKS:
                    self.cancelled.add(attempt)
        elif op.kind == "dead":
            self.result.note("dead", op.detail)
        elif op.kind == "block" and op.attempt is not None:
            self.block(op, op.attempt)
        elif op.kind == "call":
            self.calls[op.detail] += 1
            if self.calls[op.detail] > 1:
                self.result.note("duplicated", f"call {op.detail} at {op.t:.2f}s")
            elif op.epoch < self.cancel_epoch:
                self.result.note("stale", f"call {op.detail} of epoch {op.epoch} after "
                                 f"cancel {self.cancel_epoch}")  # fmt: skip

    def block(self, op: Op, attempt: Attempt) -> None:
        key = (attempt, op.block)
        self.seen[key] += 1
        if self.seen[key] > 1:
            self.result.note("duplicated", f"{key} at {op.t:.2f}s")
            return
        if op.epoch < self.cancel_epoch:
            self.result.note("stale", f"{key} of epoch {op.epoch} after cancel {self.cancel_epoch}")
        if self.last_block is not None and key < self.last_block:
            self.result.note("out_of_order", f"{key} after {self.last_block}")
        self.last_block = key if self.last_block is None else max(key, self.last_block)
        self.arrivals.setdefault(attempt, []).append(op.t)

    def owed(self, stall_s: float) -> None:
        """Every acknowledged answer not cancelled must be complete, without long stalls."""
        for attempt in sorted(self.acked - self.cancelled):
            got = self.arrivals.get(attempt, [])
            if len(got) < BLOCKS:
                self.result.note("lost", f"{attempt} ({len(got)} of {BLOCKS} blocks)")
                continue
            times = [self.sent_at.get(attempt, got[0]), *got]
            gap = max(b - a for a, b in itertools.pairwise(times))
            if gap > stall_s:
                self.result.note("stalled", f"{attempt} waited {gap:.1f}s")


def _check_client(history: History, stall_s: float) -> ClientResult:
    walk = _ClientCheck(history)
    for op in history.ops:
        walk.op(op)
    walk.owed(stall_s)
    return walk.result


def _owed_intervals(history: History) -> list[tuple[float, float | None]]:
    """(from, until) spans during which the client waited for an owed answer."""
    spans: list[tuple[float, float | None]] = []
    start: float | None = None
    count: Counter[Attempt] = Counter()
    outstanding: Attempt | None = None
    for op in history.ops:
        if op.kind == "send" and op.attempt is not None:
            outstanding, start = op.attempt, op.t
        elif op.kind in ("cancel_sent", "cancelled") and start is not None:
            spans.append((start, op.t))
            start = None
        elif op.kind == "block" and outstanding is not None and op.attempt == outstanding:
            count[outstanding] += 1
            if count[outstanding] >= BLOCKS and start is not None:
                spans.append((start, op.t))
                start = None
    if start is not None:
        spans.append((start, None))
    return spans


STALL_S = 1.0
"""A wait without progress at least this long is a stall (see ``_recovery``)."""
AFTERMATH_S = 1.0
"""A stall that begins this soon after a fault is the fault's."""


def _gaps(history: History, blocks: list[float]) -> list[tuple[float, float]]:
    """(from, until) of every wait between two steps of progress on an owed answer:
    its send, each block, its end (an open wait ends with the history)."""
    last = history.ops[-1].t if history.ops else 0.0
    gaps: list[tuple[float, float]] = []
    for start, end in _owed_intervals(history):
        until = last if end is None else end
        inside = blocks[bisect.bisect_right(blocks, start) : bisect.bisect_right(blocks, until)]
        gaps += itertools.pairwise([start, *inside, until])
    return gaps


def _client_recovery(
    fault: Fault, blocks: list[float], gaps: list[tuple[float, float]]
) -> float | None:
    """How long after ``fault`` one client was served again (None: it owed nothing)."""
    delay: float | None = None
    owed = [a for a, b in gaps if b > fault.t and a <= fault.t + AFTERMATH_S]
    if owed:  # waiting when the fault struck, or soon after: its next block
        after = bisect.bisect_right(blocks, max(fault.t, owed[0]))
        if after < len(blocks):
            delay = blocks[after] - fault.t
    for a, b in gaps:
        if fault.t <= a <= fault.t + AFTERMATH_S and b - a >= STALL_S:
            delay = max(delay or 0.0, b - fault.t)
    return delay


def _recovery(
    histories: Sequence[History], faults: list[Fault]
) -> list[tuple[Fault, float | None]]:
    """Each fault's recovery: the longest, over the clients, of the time from the fault
    until a client owed an answer was served again. That is its next block when the
    fault caught it waiting (or it began waiting within ``AFTERMATH_S``); and when a
    stall (``STALL_S`` or more without progress) began within ``AFTERMATH_S`` of the
    fault (blocks already on their way arrive first, then nothing: the fault's
    effect), until that stall ended. A fault aimed at one client (``client-N``) is
    judged on that client alone. None: the fault caught no client waiting."""
    blocks = {h.client: [op.t for op in h.ops if op.kind == "block"] for h in histories}
    gaps = {h.client: _gaps(h, blocks[h.client]) for h in histories}
    struck: list[tuple[Fault, float | None]] = []
    for fault in faults:
        aimed = _aimed(fault)
        clients = [int(aimed)] if aimed.isdigit() and int(aimed) in gaps else list(gaps)
        delays = [_client_recovery(fault, blocks[c], gaps[c]) for c in clients]
        found = [d for d in delays if d is not None]
        struck.append((fault, max(found) if found else None))
    return struck


def summarize(op_counts: Iterable[Op]) -> Counter[str]:
    """How many operations of each kind (for the report)."""
    return Counter(op.kind for op in op_counts)
