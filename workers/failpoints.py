"""Fault-injection points for the fault tests, off unless an env variable names one.

``DUPLEXQ_FAILPOINT=<point>:<seq>[:<seconds>]`` makes the worker, on reaching
``point`` for a step covering the input with that ``seq``, write the file named by
``DUPLEXQ_FAILPOINT_MARKER`` and then block its whole process (a synchronous
sleep: no heartbeat, no I/O) for ``seconds`` (default: an hour). The fault
tests wait for the marker and then SIGKILL or SIGSTOP the process, so a crash
lands exactly between two steps of the protocol.

Points: ``after_read`` (an event was read, nothing handled or published),
``before_publish`` (outputs are ready, the atomic publish has not run),
``after_publish`` (outputs and progress were published, nothing after).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_SPEC = os.environ.get("DUPLEXQ_FAILPOINT", "")


def _parse(spec: str) -> tuple[str, int, float] | None:
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"DUPLEXQ_FAILPOINT must be point:seq[:seconds], got {spec!r}")
    seconds = float(parts[2]) if len(parts) == 3 else 3600.0
    return parts[0], int(parts[1]), seconds


_ACTIVE = _parse(_SPEC)
_fired = False


def failpoint(point: str, first_seq: int, last_seq: int | None = None) -> None:
    """Block here if the environment named this point and a seq in [first, last] (once)."""
    global _fired  # noqa: PLW0603 - one process-wide flag, set once
    if _ACTIVE is None or _fired or _ACTIVE[0] != point:
        return
    if not first_seq <= _ACTIVE[1] <= (first_seq if last_seq is None else last_seq):
        return
    _fired = True
    marker = os.environ.get("DUPLEXQ_FAILPOINT_MARKER")
    if marker:
        Path(marker).write_text(f"{point}:{_ACTIVE[1]}:{os.getpid()}")
    time.sleep(_ACTIVE[2])
