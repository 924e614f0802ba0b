"""When a streaming answer's outputs are published: coalescing (pure; the clock is passed in).

A backend streaming an answer yields one ``flush`` draft per step (a token, a
sentence of audio). Publishing each at once costs one publish script, one
Redis round trip and one wake-up of every reader per step. The actor instead
asks a ``Coalescer`` (one per answer) after staging each flush draft:

- the answer's first flush draft of each kind (its first text, its first audio) is
  published at once: the time to first output does not change, nor the time to
  first audio of an answer whose transcript comes first (``tests/test_coalesce.py``);
- a later one is published at once if the window (``Settings.coalesce_ms``)
  has passed since the answer's last publish, so a stream slower than the
  window pays nothing;
- otherwise it is held, and what is held goes out together when the window
  ends (``deadline``) or when ``cap`` (``Settings.coalesce_max``) drafts are
  held, whichever comes first;
- whatever is still held when the answer ends is published then (the actor
  does that; ``held`` says whether there is any).

Coalescing only groups publishes: every draft stays its own output with its
own ``seq``, in order, so a client sees the same deltas. How long each held
draft waited is what coalescing adds to its latency (``waits``; the actor
reports it as ``duplexq_coalesce_delay_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.config import Settings


@dataclass(frozen=True, slots=True)
class CoalescePolicy:
    """The window and cap of a stage's coalescing."""

    window_s: float
    """Longest a held draft waits; 0 turns coalescing off."""
    cap: int
    """Most drafts held before they are published, window or not."""

    @classmethod
    def of(cls, settings: Settings) -> CoalescePolicy:
        return cls(settings.coalesce_ms / 1000, settings.coalesce_max)


DEFAULT_POLICY = CoalescePolicy.of(Settings())


class Coalescer:
    """One answer's coalescing decisions (times in seconds, any monotonic clock)."""

    def __init__(self, policy: CoalescePolicy) -> None:
        self.policy = policy
        self.last_publish: float | None = None
        """When the answer's last publish began (None: nothing published yet)."""
        self.staged_at: list[float] = []
        """When each held draft was staged, oldest first."""
        self.kinds: set[str] = set()
        """The kinds of draft staged so far."""

    @property
    def held(self) -> int:
        return len(self.staged_at)

    @property
    def deadline(self) -> float | None:
        """When what is held must be published (None: nothing held)."""
        if not self.staged_at or self.last_publish is None:
            return None
        return self.last_publish + self.policy.window_s

    def hold(self, now: float, kind: str = "") -> bool:
        """A flush draft of ``kind`` was staged at ``now``; True: publish it (and all
        held) now."""
        self.staged_at.append(now)
        first = kind not in self.kinds
        self.kinds.add(kind)
        return (
            first
            or self.last_publish is None
            or len(self.staged_at) >= self.policy.cap
            or now - self.last_publish >= self.policy.window_s
        )

    def published(self, now: float) -> list[float]:
        """A publish carrying every held draft began at ``now``: how long each waited."""
        waits = [now - staged for staged in self.staged_at]
        self.staged_at = []
        self.last_publish = now
        return waits
