"""A full Redis: the writes it refuses for memory, told apart and waited out.

Redis at its ``maxmemory`` with ``noeviction`` (what ships: ``docs/deploy.md``, "Redis
memory") refuses every command that may add data with ``OOM command not allowed when
used memory > 'maxmemory'``, and a script whose first such write is refused stops
there, having written nothing. Reads, deletes, trims and the scripts flagged
``allow-oom`` (lease renewals, attachment holds and detaches, index rescoring:
``dataplane.scripts.ALLOW_OOM``) still run.

The adapter (``dataplane.bus``, ``dataplane.replicated``) raises such a refusal as
``RedisFullError`` (code ``redis_full``), never as redis-py's exception. The coordinator
answers the client event that needed the write with it and goes on; a worker waits for
room (``until_room``) instead of failing, dropping or skipping anything
(``tests/test_redis_full.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from redis.exceptions import OutOfMemoryError, ResponseError

from schemas.errors import RedisFullError

T = TypeVar("T")

OOM_REPLY = "OOM command not allowed"
"""How Redis's refusal starts (also inside a script's error, which redis-py may raise as
a plain ``ResponseError``)."""

FIRST_WAIT_S = 0.02
MAX_WAIT_S = 0.5
"""Backoff between attempts while Redis is full: the first wait, doubled up to this,
so the wait after Redis has room again is at most about half a second."""


def refused_for_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write because it is full."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and OOM_REPLY in str(exc)
    )


def full_error(exc: BaseException) -> RedisFullError:
    """The duplexq error for a refusal ``exc`` (raise it ``from exc``)."""
    return RedisFullError(
        "Redis is full (maxmemory reached) and refused a write; nothing of this call was "
        f"kept; retry once it has room ({exc})"
    )


async def until_room(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    log: logging.Logger,
    wanted: Callable[[], bool] = lambda: True,
    extra: Mapping[str, Any] | None = None,
) -> T | None:
    """``call()``, made again with backoff for as long as a full Redis refuses it; None
    (as from a ``call`` that returns None) when ``wanted()`` turned false meanwhile: the
    caller stopped, and no call was made after that.

    Only a refusal for memory is retried: a refused call wrote nothing, so making it
    again is the same call. The first refusal is logged as a warning, the end of the
    wait once, so a long outage does not fill the log."""
    wait = FIRST_WAIT_S
    refusals = 0
    while True:
        try:
            result = await call()
        except RedisFullError:
            refusals += 1
            if refusals == 1:
                log.warning("Redis is full: %s was refused; retrying until it has room",
                            what, extra=extra)  # fmt: skip
            await asyncio.sleep(wait)
            wait = min(wait * 2, MAX_WAIT_S)
            if not wanted():
                return None
            continue
        if refusals:
            log.info("Redis took %s after %d refusals", what, refusals, extra=extra)
        return result
