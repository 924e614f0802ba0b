"""Script calls made in the same event-loop turn go to Redis in one round trip.

A coordinator appending for many sessions, or a worker publishing for many
actors, makes many independent script calls at once. Sent one by one, each
costs a round trip and most of the Python CPU of a command (the notes in
``docs/benchmarks.md``); pipelined, the cost per call falls several times.
``ScriptBatcher`` collects the calls issued during one turn of the event loop
and sends them as one pipeline (no transaction) on the next turn; under load,
a batch that would follow the previous one within the linger
(``dataplane.pacing``) waits out the rest and carries what came meanwhile.

With a ``batch_size`` (Kafka's producer ``batch.size``), a batch that fills up
is sent at once, written to the socket before the turn's later calls are made,
and those form the next batch: Redis runs one batch while the caller builds
the next (``tests/test_batching.py``). The coordinator ships without one
(``Settings.append_batch`` 0): on a Redis that fsyncs its AOF before every
reply, each batch would wait for an fsync of its own, where a whole turn's
appends share one (docs/scaling.md measures both).

Several calls of one script in a batch go as one call of its *multi* form
(``dataplane.multi``): one script call's fixed cost in Redis, paid once per batch.

Ordering. A producer makes its calls on one session one at a time (it waits
for each reply), so two calls that must stay in order are never in the same
batch: calls in one batch are independent, and each script's calls keep the
order in which they were made.

Retries. A batch lost with its connection is sent again as a whole; every
script recognises a repeat (``dataplane.scripts``). A call refused with
NOSCRIPT (Redis restarted and lost its script cache) ran nothing: the batch's
scripts are loaded and those calls are sent again, in their order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from redis.exceptions import NoScriptError

from dataplane.multi import Multi, group_command, group_replies, multi_of
from dataplane.pacing import Pacer

MAX_BATCH = 256
"""Most calls one pipeline carries; a turn with more sends several."""

_Started = tuple[dict[str, list["Call"]], int, Any]
"""A batch being sent: its calls grouped by script, the SCRIPT LOADs ahead of its
replies, and what ``Pipe.start`` returned for it."""


class Call:
    """A script call waiting for its batch: what to run and where its reply goes."""

    __slots__ = ("args", "future", "keys", "script")

    def __init__(
        self, script: Any, keys: Sequence[str], args: Sequence[Any], future: asyncio.Future[Any]
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.future = future


def settle(call: Call, outcome: Any) -> None:
    """Answer a call (an exception is raised to its caller), unless its caller gave up."""
    if call.future.done():
        return
    if isinstance(outcome, BaseException):
        call.future.set_exception(outcome)
    else:
        call.future.set_result(outcome)


class Pipe(Protocol):
    """Where batches go: one Redis, one round trip per batch."""

    def start(self, commands: Sequence[Sequence[Any]]) -> Any:
        """Begin sending ``commands``, now where the pipe can (``Lane.start``); the
        replies come from ``replies`` with what this returned."""

    async def replies(self, started: Any) -> list[Any]:
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

    def start(self, commands: Sequence[Sequence[Any]]) -> Any:
        return commands  # redis-py writes when the replies are awaited

    async def replies(self, started: Any) -> list[Any]:
        return await self.pipeline(started)

    async def load(self, script: str) -> None:
        await self.client.script_load(script)


class ScriptBatcher:
    """Coalesces concurrent script calls on one Redis into pipelines."""

    def __init__(self, pipe: Pipe, linger_ms: float = 0.0, batch_size: int = 0) -> None:
        self.pipe = pipe
        self.batch_size = batch_size
        """A batch this big is sent at once instead of at the end of the turn (0: never)."""
        self._pacer = Pacer(linger_ms)
        """A batch that would follow the previous one within the linger waits for it."""
        self._pending: list[Call] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._multis: dict[str, Multi] = {}
        """Each script's multi form, by the script's sha."""

    async def run(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run ``script``; its reply comes once the batch it joined is answered."""
        # The loop is looked up once per call: on Python 3.11 each lookup is a getpid()
        # system call (the running loop is checked against the process).
        loop = asyncio.get_running_loop()
        call = Call(script, keys, args, loop.create_future())
        if not self._pending:
            wait = self._pacer.due_in()
            if wait > 0:
                loop.call_later(wait, self._flush)
            else:
                loop.call_soon(self._flush)
        self._pending.append(call)
        if len(self._pending) == self.batch_size:
            self._flush()  # the rest of the turn's calls form the next batch
        return await call.future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return  # sent already, as a full batch
        self._pacer.started()
        self._pacer.carried(len(pending))
        for start in range(0, len(pending), MAX_BATCH):
            calls = pending[start : start + MAX_BATCH]
            # Written now (a connected lane): Redis runs this batch while the loop goes on.
            try:
                first = self._start(calls)
            except Exception as exc:  # its callers hear of it; the batcher goes on
                for call in calls:
                    settle(call, exc)
                continue
            task = asyncio.create_task(self._send(calls, first))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, calls: list[Call], first: _Started) -> None:
        try:
            todo = await self._finish(first)
            for _ in range(2):  # refused with NOSCRIPT: load the scripts and send again
                if not todo:
                    return
                await self._load({id(c.script): c.script for c in todo}.values())
                todo = await self._finish(self._start(todo))
            for call in todo:
                settle(call, NoScriptError("the script cache keeps losing scripts"))
        except BaseException as exc:
            for call in calls:
                settle(call, exc)
            if not isinstance(exc, Exception):
                raise

    async def _finish(self, started: _Started) -> list[Call]:
        """Wait for a started batch's replies; settle its calls; return those refused with
        NOSCRIPT."""
        groups, loads, began = started
        return self._settle_groups(groups, (await self.pipe.replies(began))[loads:])

    def _start(self, calls: list[Call]) -> _Started:
        """Start sending ``calls``: their groups by script, how many SCRIPT LOADs lead the
        replies, and what the pipe began."""
        groups: dict[str, list[Call]] = {}
        for call in calls:
            groups.setdefault(call.script.sha, []).append(call)
        commands = [self._command(group) for group in groups.values()]
        # A multi form this batcher has not sent yet is loaded ahead of its first use, in
        # the same round trip (after a Redis restart, NOSCRIPT reloads it as any script).
        loads = [("SCRIPT", "LOAD", m.script) for m in self._multis.values() if not m.sent]
        for multi in self._multis.values():
            multi.sent = True
        return groups, len(loads), self.pipe.start(loads + commands)

    def _settle_groups(self, groups: dict[str, list[Call]], replies: list[Any]) -> list[Call]:
        """Settle each group's calls with its reply; return those refused with NOSCRIPT."""
        missing: list[Call] = []
        for group, reply in zip(groups.values(), replies, strict=True):
            if isinstance(reply, NoScriptError):
                missing += group
                continue
            for call, each in zip(group, group_replies(group, reply), strict=True):
                settle(call, each)
        return missing

    def _command(self, group: list[Call]) -> tuple[Any, ...]:
        return group_command(group, self._multi)

    def _multi(self, script: Any) -> Multi:
        return multi_of(self._multis, script)

    async def _load(self, scripts: Iterable[Any]) -> None:
        for script in scripts:
            await self.pipe.load(script.script)
            if script.sha in self._multis:
                await self.pipe.load(self._multis[script.sha].script)
