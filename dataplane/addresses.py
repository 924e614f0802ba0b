"""Redis's address for a new connection: looked up by name, and the last answer kept.

Connecting to ``redis:6379`` looks the name up first (``getaddrinfo``, in a
thread). Measured on Docker (docker-compose 1.29, Docker 20.10): while the
Redis container restarts, its name leaves the network's DNS for about half a
second, and a lookup made then is not answered for 5 s (the resolver's
timeout), although Redis is back, at the same address, well before. Every
connection a process made in that half second waited those 5 s, longer than a
lease's 3 s TTL: every worker lost every session it held at once.

So a lookup that does not answer within ``FALLBACK_WAIT_S`` is not waited for
when the name had an answer before: the connection goes to that last address
(a restarted Redis keeps its address on Docker and behind a Kubernetes
Service). The lookup goes on in the background and its answer, when it comes,
is the one used next. A name never answered yet waits for its lookup. If the
address has really changed, connecting to the old one fails (refused, or the
connect timeout) and the next try takes the new answer.

Lookups run on their own small thread pool, one at a time per name: a stuck
lookup never holds up the default executor that stages use for their models
(VAD, ASR), however many connections retry meanwhile
(``tests/test_addresses.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger("duplexq.addresses")

FALLBACK_WAIT_S = 0.25
"""How long a lookup is waited for when the name has an earlier answer to fall back on."""
LOOKUP_THREADS = 2


Found = tuple[str, ...]
"""A name's addresses, in the order the system's resolver gives them (to try in turn:
``localhost`` may be ``::1`` first while Redis listens on ``127.0.0.1`` only)."""


def _lookup(host: str, port: int) -> Found:
    """The TCP addresses of ``host`` (blocking)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
    if not found:
        raise OSError(f"no address for {host}")
    return found


class Addresses:
    """Host name to address, for one process (every event loop in it)."""

    def __init__(self) -> None:
        self._known: dict[str, Found] = {}
        self._pending: dict[str, concurrent.futures.Future[Found]] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            LOOKUP_THREADS, thread_name_prefix="duplexq-lookup"
        )
        self.lookup = _lookup
        """The blocking lookup (replaced only by tests that make lookups hang)."""

    async def resolve(self, host: str, port: int, timeout_s: float) -> Found:
        """The addresses to connect to for ``host``: a fresh answer if it comes in time,
        else the last one; raises ``OSError`` (or ``TimeoutError`` after ``timeout_s``)
        for a name that never had one."""
        if _is_address(host):
            return (host,)
        known = self._known.get(host)
        waiting = asyncio.wrap_future(self._start(host, port))
        try:
            async with asyncio.timeout(FALLBACK_WAIT_S if known is not None else timeout_s):
                return await asyncio.shield(waiting)
        except TimeoutError:
            if known is None:
                raise TimeoutError(f"looking up {host} took over {timeout_s:.1f} s") from None
            log.info("looking up %s is slow; connecting to its last address %s", host, known[0])
            return known
        except OSError:
            if known is None:
                raise
            return known  # a failed lookup (the name briefly gone): the last address

    def _start(self, host: str, port: int) -> concurrent.futures.Future[Found]:
        """The lookup of ``host`` under way, or a new one."""
        with self._lock:
            pending = self._pending.get(host)
            if pending is not None:
                return pending
            pending = self._pool.submit(self.lookup, host, port)
            self._pending[host] = pending
        # Outside the lock: a lookup already done runs its callback here and now.
        pending.add_done_callback(lambda done: self._finished(host, done))
        return pending

    def _finished(self, host: str, done: concurrent.futures.Future[Found]) -> None:
        with self._lock:
            if self._pending.get(host) is done:
                del self._pending[host]
            if not done.cancelled() and done.exception() is None:
                self._known[host] = done.result()


T = TypeVar("T")


async def connect_first(found: Found, connect: Callable[[str], Awaitable[T]]) -> T:
    """``connect(address)`` for each of ``found`` in turn until one connects; the last
    one's error when none does."""
    for address in found[:-1]:
        try:
            return await connect(address)
        except OSError:
            continue
    return await connect(found[-1])


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


ADDRESSES = Addresses()
"""This process's addresses: shared by every connection it makes to Redis."""
