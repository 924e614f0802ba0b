"""The control plane's decisions, pure: no Redis, no asyncio.

``coordinator.controlplane.control`` runs the jobs; what each job decides lives here so it
can be tested on plain values:

- trimming: how far a stream may be trimmed given where its consumers are
  (``safe_min_id``), where the retention floor lies while walking a stream
  (``floor_in_page``), who consumes which stream (``stream_consumers``), how far
  an assignment stream's consumer group lets it go (``group_floor``);
- the lease audit: what to do for one indexed session (``plan_audit``: re-offer
  stages nobody holds, close a session whose client is gone for longer than the
  resume grace), and how often to re-offer one nobody takes (``RequeueBackoff``);
- expiry: whose key a key is (``session_of_key``; the rule itself, only a
  session that is not open expires, is the ``EXPIRE_CLOSED`` script);
- how often the periodic jobs run (``ControlSchedule``).

Stream ids compare as (milliseconds, sequence) pairs, never as strings:
``"10-0"`` is newer than ``"9-5"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from schemas.config import SESSION_INPUT, PipelineConfig

FORGET_GRACE_MS = 60_000
"""An indexed session without meta is forgotten only this long after it was indexed
(``open`` indexes the id just before its script creates the meta)."""


# -- trimming ----------------------------------------------------------------------


def parse_id(entry_id: str) -> tuple[int, int]:
    """A stream id as a comparable pair; ``"5"`` means ``"5-0"`` as in Redis."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def safe_min_id(reads: Sequence[str | None], retention_floor: str | None) -> str | None:
    """The MINID a stream may be trimmed to, or None to leave it alone.

    ``reads``: the last entry each consumer of the stream has applied (None:
    that consumer has read nothing yet, so nothing may go). ``retention_floor``:
    the oldest entry the retention keeps (None: the stream is within its
    retention). Entries older than the result go; the result itself stays.
    """
    if retention_floor is None or any(read is None for read in reads):
        return None
    floor = min([retention_floor, *(r for r in reads if r is not None)], key=parse_id)
    return None if parse_id(floor) == (0, 0) else floor


def age_floor(now_ms: int, retention_s: int) -> str | None:
    """The oldest stream id a time retention keeps (None: no time retention)."""
    return f"{now_ms - retention_s * 1000}-0" if retention_s else None


def newest(*ids: str | None) -> str | None:
    """The newest of the ids given (None when there is none)."""
    known = [i for i in ids if i is not None]
    return max(known, key=parse_id) if known else None


def floor_in_page(ids: Sequence[str], to_skip: int, stop_at: str | None) -> tuple[str | None, int]:
    """Walk one page of ids, oldest first, looking for the retention floor.

    The floor is the entry after ``to_skip`` more entries, or the first one at
    or past ``stop_at`` (the oldest consumer position) if that comes sooner.
    Returns (floor or None, entries skipped in this page).
    """
    stop = parse_id(stop_at) if stop_at is not None else None
    for index, entry_id in enumerate(ids):
        if index >= to_skip or (stop is not None and parse_id(entry_id) >= stop):
            return entry_id, index
    return None, len(ids)


def stream_consumers(pipeline: PipelineConfig) -> dict[str, tuple[str, ...]]:
    """For the session log (``session``) and each stage: the stages that read it."""
    sources = (SESSION_INPUT, *pipeline.stage_names)
    return {
        source: tuple(s.name for s in pipeline.stages if s.input == source) for source in sources
    }


def group_floor(groups: Sequence[tuple[str, str, str | None]]) -> str | None:
    """How far an assignment stream may be trimmed: below every group's oldest
    pending entry and its last delivered one. ``groups``: (name, last delivered,
    oldest pending or None)."""
    if not groups:
        return None
    bounds = [pending or delivered for _, delivered, pending in groups]
    floor = min(bounds, key=parse_id)
    return None if parse_id(floor) == (0, 0) else floor


# -- audit and expiry ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuditPlan:
    """What the audit does for one indexed session."""

    forget: bool = False
    """Drop the id from the sessions index (closed, or its meta is gone)."""
    requeue: tuple[str, ...] = ()
    """Stages whose lease is absent: offer the session to their workers again."""
    close: bool = False
    """Its client connection went away longer ago than the resume grace: close it."""


def plan_audit(
    status: str | None,
    leased: Mapping[str, bool],
    age_ms: int,
    detached_ms: int | None = None,
    grace_ms: int = 0,
) -> AuditPlan:
    """Decide for one session from its meta status, its stages' leases, how long it
    has been indexed and how long ago its client connection's hold lapsed
    (``detached_ms``; None for a session no client connection ever held)."""
    if status == "open":
        if detached_ms is not None and detached_ms > grace_ms:
            return AuditPlan(close=True)
        return AuditPlan(requeue=tuple(stage for stage, held in leased.items() if not held))
    if status is None and age_ms < FORGET_GRACE_MS:
        return AuditPlan()  # being opened right now
    return AuditPlan(forget=True)


def session_of_key(prefix: str, key: str) -> str | None:
    """The session id in a per-session key ``{prefix}:{p<n>}:{sid}:<kind>``, or None.

    The id may contain anything, ``:`` included; the kind is one of the fixed
    suffixes, or ``st:<stage>`` / ``lease:<stage>`` (stage names have no ``:``)."""
    head = f"{prefix}:{{p"
    start = key.find("}:", len(head))
    if not key.startswith(head) or start < 0:
        return None
    rest = key[start + 2 :]
    body, _, tail = rest.rpartition(":")
    if body.endswith((":st", ":lease")):
        body = body.rpartition(":")[0]
    elif tail not in _SESSION_KEY_KINDS:
        return None
    return body or None


_SESSION_KEY_KINDS = frozenset({"meta", "in", "ctl", "out", "prog"})


class RequeueBackoff:
    """Per-process memory of audit re-queues: a session nobody takes is offered
    again after a gap that doubles each time, so queues do not fill up."""

    def __init__(self, base_ms: int, cap_ms: int) -> None:
        self.base_ms = base_ms
        self.cap_ms = cap_ms
        self._due: dict[tuple[str, str], tuple[int, int]] = {}

    def take(self, key: tuple[str, str], now: int) -> bool:
        """True (and remember it) if ``key`` may be re-queued at ``now``."""
        due, gap = self._due.get(key, (0, self.base_ms // 2))
        if now < due:
            return False
        gap = min(gap * 2, self.cap_ms)
        self._due[key] = (now + gap, gap)
        return True

    def clear(self, session_id: str, stage: str | None = None) -> None:
        """Forget a session (one stage of it, or all): it was taken, or closed."""
        for key in [k for k in self._due if k[0] == session_id and stage in (None, k[1])]:
            del self._due[key]


@dataclass(frozen=True, slots=True)
class ControlSchedule:
    """How often the periodic jobs run (seconds, 1..60, on wall-clock seconds)."""

    audit_every_s: int = 2
    """Lease audit; a lost assignment waits at most about this long."""
    trim_every_s: int = 10
    """Retention trimming."""
    expire_every_s: int = 60
    """Closed-session expiry safety net (scans every session key)."""

    def seconds(self, every_s: int) -> set[int]:
        if not 1 <= every_s <= 60:
            raise ValueError(f"a control job runs every 1..60 s, not {every_s}")
        return set(range(0, 60, every_s))
