"""Scripts on Redis Cluster, acknowledged once a replica has them.

On one Redis, a script's reply means its writes are in the AOF, fsynced
(``REDIS_PERSISTENCE``). A cluster primary replicates asynchronously: killed
right after it replied, its promoted replica may lack the write. So on a
cluster every script is sent with ``WAIT 1`` on the same connection, in the
same round trip, and its reply counts only once the primary's replica has the
writes too. What an acknowledged write survives, then: the loss of any one
node (``tests/test_cluster.py`` kills a primary with SIGKILL while clients
append and checks every acknowledged input).

Script calls made in the same turn of the event loop are grouped by the node
serving their slot and sent to each node in one round trip, closed by one
``WAIT 1``: WAIT answers for every write made before it on its connection, so
one replica acknowledgement covers the whole batch, and no call's reply is
given before it came (``tests/test_cluster.py`` counts the round trips). A
script's calls in a node's batch go as one EVALSHA, of its cross-slot form when
they are of several slots (``dataplane.multi``): the node runs, fsyncs and
replicates them together, not once per slot. As on one Redis
(``dataplane.batching``), calls in one batch are independent: a producer waits
for a call's reply before it makes the next on that session.

A lease renewal is the exception (``ReplicatedRunner.no_wait``): it is answered
once its primary ran it, without ``WAIT``. Lost with its primary, a renewal only
shortens its lease on the promoted replica (the session may move to another
worker, and its old owner's publishes are refused); waiting for a slow replica, it
kept the next renewal of its lease from being sent, and a lease lapsed although
every renewal of it succeeded (``tests/test_heartbeat.py``).

A primary that has no replica (its replica failed, or it is a promoted replica
whose old primary has not rejoined) cannot get a replica's acknowledgement;
it serves on, acknowledging on its own, until a replica rejoins: a second
failure in that window can lose writes, as with any one-copy store. Such
writes are counted (``duplexq_unreplicated_writes_total``).

A failover error (``dataplane.cluster.FAILOVER_ERRORS``: a dead node,
``CLUSTERDOWN``...), a redirection (``MOVED``, ``ASK``, ``READONLY`` from a
demoted primary) or a missing replica acknowledgement is retried, after the slot
map is learnt again, with backoff for up to ``dataplane.cluster.RETRY_S``: the
same call is sent again (on its own, out of its batch), and a script that had
landed recognises the repeat (``dataplane.scripts``), so a caller never sees an
error for a write that may have landed while a retry could still tell. So is a
cross-slot call that found a key of its own served elsewhere now (``NotLocalError``:
its slot moved or is migrating) or the cluster down (``ClusterDownError``); it wrote
nothing (``tests/test_cross_slot.py``).

On a plain-TCP cluster the batches go over lanes (``dataplane.lane``: replies
parsed by hiredis) instead of redis-py's cluster connections, whose reply
parsing in Python was a large share of a process's CPU per event. A ``WAIT``
holds its connection (Redis runs nothing sent after it on that connection until
it returns: a second or more when a replica is slow or cut off), so each batch
in flight has a lane of its own, taken from a pool per node as from a pool of
connections (``dataplane.lane_pool``); a lease renewal never queues behind a ``WAIT``.

A node at its ``maxmemory`` refuses a script's first write and the script writes
nothing: that is raised at once as ``RedisFullError`` (``dataplane.full``), not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import Any

from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)

from dataplane.batching import MAX_BATCH, Call, settle
from dataplane.cluster import FAILOVER_ERRORS, RETRY_S, ClientClosedError, slot_of
from dataplane.full import full_error, refused_for_memory
from dataplane.lane_pool import LanePool
from dataplane.metrics import UNREPLICATED_WRITES
from dataplane.multi import (
    DOWN,
    NOT_LOCAL,
    Multi,
    cross_slot_command,
    group_command,
    group_replies,
    multi_of,
)
from dataplane.node_lanes import NodeLanes, named_error
from dataplane.replica_count import ReplicaCounts


class NotReplicatedError(RuntimeError):
    """The primary has a replica, but it did not acknowledge the writes in time."""


class NotLocalError(RuntimeError):
    """A call of a cross-slot multi (``dataplane.multi``) found a key of its own not
    served by the node now (its slot moved, or is migrating): it wrote nothing."""


RETRIED: tuple[type[BaseException], ...] = (
    *FAILOVER_ERRORS,
    MovedError,
    AskError,
    ReadOnlyError,
    NotReplicatedError,
    NotLocalError,
)


class ReplicatedRunner:
    """Runs scripts on a cluster client with a replica's acknowledgement."""

    def __init__(
        self,
        cluster: Any,
        *,
        wait_ms: int = 1000,
        lanes: NodeLanes | None = None,
    ) -> None:
        self.cluster = cluster
        self.wait_ms = wait_ms
        self.pool = LanePool(cluster, lanes) if lanes is not None else None
        """A lane per batch in flight to each node (None: redis-py's connections are
        used, as on a TLS cluster)."""
        self._multis: dict[str, Multi] = {}
        """Each script's multi form, by the script's sha."""
        self._loaded: set[tuple[str, str]] = set()
        """(node name, multi sha): multi forms sent to a node already."""
        self._replicas = ReplicaCounts(self._send)
        self._pending: list[Call] = []
        """Calls made in this turn of the event loop, sent at its end."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.unacknowledged: set[str] = set()
        """Shas of the scripts whose replies do not wait for a replica (``no_wait``)."""

    def no_wait(self, script: Any) -> None:
        """Answer ``script``'s calls once the primary ran them, without ``WAIT``: for lease
        renewals. A renewal lost with its primary only shortens the lease on the promoted
        replica (the session may move; the old owner's publishes are refused), while a
        renewal that waited for a slow replica kept the next one of its lease from being
        sent (one renewal of a lease in flight at a time: ``workers.heartbeat``), and a
        lease whose TTL is under a WAIT's timeout lapsed although every renewal of it
        succeeded (``tests/test_heartbeat.py``)."""
        self.unacknowledged.add(script.sha)

    async def run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run ``script``; its reply comes once a replica has the writes of its batch."""
        if self._closed:
            raise ClientClosedError("the Redis Cluster client is closed")
        loop = asyncio.get_running_loop()
        call = Call(script, keys, args, loop.create_future())
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append(call)
        try:
            return await call.future
        except ResponseError as exc:
            if refused_for_memory(exc):
                raise full_error(exc) from exc
            raise

    def _flush(self) -> None:
        calls, self._pending = self._pending, []
        if self._closed:  # closed in the turn these calls were made
            for call in calls:
                settle(call, ClientClosedError("the Redis Cluster client is closed"))
            return
        task = asyncio.create_task(self._send_all(calls))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_all(self, calls: list[Call]) -> None:
        """Send each node its calls, ``MAX_BATCH`` at most a round trip; a call whose
        node is not known now (the slot map is being learnt again) goes on its own."""
        batches: dict[tuple[str, bool], tuple[Any, list[Call]]] = {}
        alone: list[Call] = []
        for call in calls:
            try:
                node = self.cluster.get_node_from_key(call.keys[0])
            except RETRIED:
                alone.append(call)
                continue
            except Exception as exc:  # anything else reaches its caller, as it always did
                settle(call, exc)
                continue
            # Calls that wait for a replica and calls that do not go in batches apart.
            key = (node.name, call.script.sha in self.unacknowledged)
            batches.setdefault(key, (node, []))[1].append(call)
        sends = [self._alone(call) for call in alone]
        for node, group in batches.values():
            sends += (self._batch(node, group[i : i + MAX_BATCH])
                      for i in range(0, len(group), MAX_BATCH))  # fmt: skip
        try:
            await asyncio.gather(*sends)
        except BaseException as exc:  # cancelled (shutdown): no caller is left waiting
            # A caller whose call the runner's close cut short hears that the client
            # closed, not a CancelledError: raised into a task nobody cancelled, that
            # reads as the task's own cancellation (``except Exception`` lets it through,
            # a timeout or a task group takes it for theirs).
            closed = self._closed and isinstance(exc, asyncio.CancelledError)
            outcome = ClientClosedError("the Redis Cluster client is closed") if closed else exc
            for call in calls:
                settle(call, outcome)
            raise

    async def _batch(self, node: Any, calls: list[Call]) -> None:
        """Send ``calls`` to ``node`` in one round trip; those that must be retried (a
        failover, a redirection, a lost script, no replica acknowledgement) are retried
        one by one."""
        try:
            replies = await self._once(node, calls)
        except RETRIED:
            replies = [None] * len(calls)  # every call is sent again on its own
        except Exception as exc:
            for call in calls:
                settle(call, exc)
            return
        retry: list[Call] = []
        lost: dict[str, str] = {}  # scripts the node did not have, by sha
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, NoScriptError):
                lost[call.script.sha] = call.script.script
            if reply is None or isinstance(reply, (NoScriptError, *RETRIED)):
                retry.append(call)
            else:
                settle(call, reply)
        if lost:
            with contextlib.suppress(*RETRIED):  # the retries below meet it again
                await self._send(node, [("SCRIPT", "LOAD", text) for text in lost.values()])
        if retry:
            await asyncio.gather(*(self._alone(call) for call in retry))

    async def _alone(self, call: Call) -> None:
        """Send one call until it is answered, through a failover for up to ``RETRY_S``."""
        deadline = time.monotonic() + RETRY_S
        delay = 0.02
        while True:
            try:
                node = self.cluster.get_node_from_key(call.keys[0])
                reply = (await self._once(node, [call]))[0]
                if isinstance(reply, NoScriptError):  # Redis lost its scripts: load, resend
                    await self._send(node, [("SCRIPT", "LOAD", call.script.script)])
                    reply = (await self._once(node, [call]))[0]
                if isinstance(reply, RETRIED):
                    raise reply
            except RETRIED as exc:
                if time.monotonic() + delay > deadline:
                    settle(call, exc)
                    return
            except Exception as exc:
                settle(call, exc)
                return
            else:
                settle(call, reply)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            await self.cluster.refresh()

    async def _once(self, node: Any, calls: list[Call]) -> list[Any]:
        """Send ``calls`` to ``node`` and, where it has a replica and they are not
        ``no_wait`` calls, ``WAIT 1`` after them; each call's reply (an error reply as its
        exception, not raised). The calls of one script go as one call of its multi form,
        as on one Redis (``dataplane.batching``), or of its cross-slot form when they are
        of several slots (``dataplane.multi``): Redis then runs the batch's calls of a
        script together, and fsyncs them and sends them to the replica together."""
        groups: dict[str, list[Call]] = {}
        for call in calls:
            groups.setdefault(call.script.sha, []).append(call)
        forms = [self._form(group) for group in groups.values()]
        loads = self._multi_loads(node, forms)
        commands: list[tuple[Any, ...]] = list(loads)
        for group, form in zip(groups.values(), forms, strict=True):
            if form is not None and form[1]:
                commands.append(cross_slot_command(group, form[0]))
            else:
                commands.append(group_command(group, self._multi))
        acknowledged = calls[0].script.sha not in self.unacknowledged  # one kind a batch
        replicas = await self._replicas.of(node) if acknowledged else 0
        if replicas:
            commands.append(("WAIT", 1, self.wait_ms))
        replies = await self._send(node, commands, raise_on_error=False, waits=bool(replicas))
        if acknowledged and not replicas:
            UNREPLICATED_WRITES.inc(len(calls))
        elif replicas and (isinstance(replies[-1], BaseException) or int(replies[-1]) < 1):
            self._replicas.forget(node)  # ask again next time
            raise NotReplicatedError(f"no replica of {node.name} acknowledged in time")
        each: dict[int, Any] = {}
        own = replies[len(loads) : len(loads) + len(groups)]
        for group, form, reply in zip(groups.values(), forms, own, strict=True):
            if form is not None and isinstance(reply, NoScriptError):
                # The node lost its scripts (a restart): the multi is loaded again next
                # time; the calls go again one by one, their own script loaded.
                self._loaded.discard((node.name, form[0].sha))
            for call, one in zip(group, group_replies(group, reply), strict=True):
                each[id(call)] = refused_in_script(one)
        return [each[id(call)] for call in calls]

    def _multi(self, script: Any) -> Multi:
        return multi_of(self._multis, script)

    def _form(self, group: list[Call]) -> tuple[Multi, bool] | None:
        """The multi form ``group`` goes as, and whether it is the cross-slot one (its
        calls are of several slots); None for a lone call (the script itself)."""
        if len(group) == 1:
            return None
        slot = slot_of(group[0].keys[0])
        cross = any(slot_of(call.keys[0]) != slot for call in group)
        return multi_of(self._multis, group[0].script, cross_slot=cross), cross

    def _multi_loads(
        self, node: Any, forms: Iterable[tuple[Multi, bool] | None]
    ) -> list[tuple[Any, ...]]:
        """SCRIPT LOAD of each multi form in ``forms`` that ``node`` was not sent yet,
        to go ahead of them in the same round trip."""
        loads: list[tuple[Any, ...]] = []
        for form in forms:
            if form is not None and (node.name, form[0].sha) not in self._loaded:
                self._loaded.add((node.name, form[0].sha))
                loads.append(("SCRIPT", "LOAD", form[0].script))
        return loads

    async def _send(
        self,
        node: Any,
        commands: list[tuple[Any, ...]],
        *,
        raise_on_error: bool = True,
        waits: bool = False,
    ) -> list[Any]:
        """Send ``commands`` on one connection in one round trip; read every reply
        (keeping the connection in step). An error reply is raised (the first one), or
        with ``raise_on_error=False`` left in its place (as redis-py's cluster error:
        ``MOVED`` as ``MovedError``...). ``waits``: the commands end with a ``WAIT``
        (the lane's timeout allows for it)."""
        if self.pool is not None:
            extra_s = self.wait_ms / 1000 if waits else 0.0
            lane = self.pool.take(node)
            try:
                raw = await lane.pipeline(commands, extra_timeout_s=extra_s)
            finally:
                self.pool.give_back(node.name, lane)
            replies = [named_error(r) if isinstance(r, Exception) else r for r in raw]
        else:
            replies = await self._send_redis_py(node, commands)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, ResponseError):
                    raise reply
        return replies

    @staticmethod
    async def _send_redis_py(node: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``_send`` on one of redis-py's connections to ``node``."""
        conn = node.acquire_connection()
        try:
            await conn.send_packed_command(conn.pack_commands(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            node._free.append(conn)  # back to the node's pool of free connections
        return replies

    async def aclose(self) -> None:
        """Stop the batches in flight (a call retried through a failover would otherwise
        go on learning the slot map, and open connections, after the client closed:
        their callers get ``ClientClosedError``) and close the lanes."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.pool is not None:
            await self.pool.aclose()


def refused_in_script(reply: Any) -> Any:
    """A call's reply, with Redis's refusals of a cross-slot call's probe
    (``dataplane.multi``) as the retried errors they stand for. The probe comes before
    anything the call writes, so a refused call wrote nothing and is sent again alone:
    a key of its own served elsewhere now (its slot moved or is migrating) is
    ``NotLocalError``; the cluster down (a primary failed and its replica not yet
    promoted) is ``ClusterDownError``, as Redis answers a command with declared keys
    then (``tests/test_cross_slot.py``)."""
    if isinstance(reply, ResponseError):
        if NOT_LOCAL in str(reply):
            return NotLocalError(str(reply))
        if DOWN in str(reply):
            return ClusterDownError(str(reply))  # type: ignore[no-untyped-call]
    return reply
