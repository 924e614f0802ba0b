"""Script calls made in the same event-loop turn go to Redis in one round trip.

A coordinator appending for many sessions, or a worker publishing for many
actors, makes many independent script calls at once. Sent one by one, each
costs a round trip and most of the Python CPU of a command (the notes in
``docs/benchmarks.md``); pipelined, the cost per call falls several times.
``ScriptBatcher`` collects the calls issued during one turn of the event loop
and sends them as one pipeline (no transaction) on the next turn; under load,
a batch that would follow the previous one within the linger
(``dataplane.pacing``) waits out the rest and carries what came meanwhile.

Ordering. A producer makes its calls on one session one at a time (it waits
for each reply), so two calls that must stay in order are never in the same
batch, and each batch keeps the order in which its calls were made.

Retries. A batch lost with its connection is sent again as a whole; every
script recognises a repeat (``dataplane.scripts``). A call refused with
NOSCRIPT (Redis restarted and lost its script cache) ran nothing: the batch's
scripts are loaded and those calls are sent again, in their order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from redis.exceptions import NoScriptError

from dataplane.pacing import Pacer

MAX_BATCH = 256
"""Most calls one pipeline carries; a turn with more sends several."""


class _Call:
    __slots__ = ("args", "future", "keys", "script")

    def __init__(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()


def _settle(call: _Call, outcome: Any) -> None:
    """Answer a call (an exception is raised to its caller), unless its caller gave up."""
    if call.future.done():
        return
    if isinstance(outcome, BaseException):
        call.future.set_exception(outcome)
    else:
        call.future.set_result(outcome)


class Pipe(Protocol):
    """Where batches go: one Redis, one round trip per ``pipeline``."""

    async def pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Replies in order; an error reply as its exception, not raised."""

    async def load(self, script: str) -> None:
        """SCRIPT LOAD."""


class RedisPyPipe:
    """A ``Pipe`` over a redis-py client (TLS and unix sockets; see ``dataplane.lane``)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        async with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return list(await pipe.execute(raise_on_error=False))

    async def load(self, script: str) -> None:
        await self.client.script_load(script)


class ScriptBatcher:
    """Coalesces concurrent script calls on one Redis into pipelines."""

    def __init__(self, pipe: Pipe, linger_ms: float = 0.0) -> None:
        self.pipe = pipe
        self._pacer = Pacer(linger_ms)
        """A batch that would follow the previous one within the linger waits for it."""
        self._pending: list[_Call] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run ``script``; its reply comes once the batch it joined is answered."""
        call = _Call(script, keys, args)
        if not self._pending:
            wait = self._pacer.due_in()
            if wait > 0:
                asyncio.get_running_loop().call_later(wait, self._flush)
            else:
                asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(call)
        return await call.future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        self._pacer.started()
        self._pacer.carried(len(pending))
        for start in range(0, len(pending), MAX_BATCH):
            task = asyncio.create_task(self._send(pending[start : start + MAX_BATCH]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, calls: list[_Call]) -> None:
        try:
            todo = calls
            for _ in range(3):
                todo = await self._send_once(todo)
                if not todo:
                    return
                await self._load({id(c.script): c.script for c in todo}.values())
            for call in todo:
                _settle(call, NoScriptError("the script cache keeps losing scripts"))
        except BaseException as exc:
            for call in calls:
                _settle(call, exc)
            if not isinstance(exc, Exception):
                raise

    async def _send_once(self, calls: list[_Call]) -> list[_Call]:
        """Send ``calls``; settle their futures; return those refused with NOSCRIPT."""
        replies = await self.pipe.pipeline(
            [("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args) for c in calls]
        )
        missing: list[_Call] = []
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, NoScriptError):
                missing.append(call)
            else:
                _settle(call, reply)
        return missing

    async def _load(self, scripts: Any) -> None:
        for script in scripts:
            await self.pipe.load(script.script)
