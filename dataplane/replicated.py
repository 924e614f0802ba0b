"""Scripts on Redis Cluster, acknowledged once a replica has them.

On one Redis, a script's reply means its writes are in the AOF, fsynced
(``REDIS_PERSISTENCE``). A cluster primary replicates asynchronously: killed
right after it replied, its promoted replica may lack the write. So on a
cluster every script is sent with ``WAIT 1`` on the same connection, in the
same round trip, and its reply counts only once the primary's replica has the
writes too. What an acknowledged write survives, then: the loss of any one
node (``tests/test_cluster.py`` kills a primary with SIGKILL while clients
append and checks every acknowledged input).

A primary that has no replica (its replica failed, or it is a promoted replica
whose old primary has not rejoined) cannot get a replica's acknowledgement;
it serves on, acknowledging on its own, until a replica rejoins: a second
failure in that window can lose writes, as with any one-copy store. Such
writes are counted (``duplexq_unreplicated_writes_total``).

A failover error (``dataplane.cluster.FAILOVER_ERRORS``: a dead node,
``CLUSTERDOWN``...), a redirection (``MOVED``, ``ASK``, ``READONLY`` from a
demoted primary) or a missing replica acknowledgement is retried, after the slot
map is learnt again, with backoff for up to ``dataplane.cluster.RETRY_S``: the
same call is sent again, and a script that had landed recognises the repeat
(``dataplane.scripts``), so a caller never sees an error for a write that may
have landed while a retry could still tell.

A node at its ``maxmemory`` refuses a script's first write and the script writes
nothing: that is raised at once as ``RedisFullError`` (``dataplane.full``), not retried.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import AskError, MovedError, NoScriptError, ReadOnlyError, ResponseError

from dataplane.cluster import FAILOVER_ERRORS, RETRY_S
from dataplane.full import full_error, refused_for_memory
from dataplane.metrics import UNREPLICATED_WRITES

REPLICA_CHECK_S = 1.0
"""How long a primary's replica count is trusted before it is asked again."""


class NotReplicatedError(RuntimeError):
    """The primary has a replica, but it did not acknowledge the writes in time."""


RETRIED: tuple[type[BaseException], ...] = (
    *FAILOVER_ERRORS,
    MovedError,
    AskError,
    ReadOnlyError,
    NotReplicatedError,
)


class ReplicatedRunner:
    """Runs scripts on a cluster client with a replica's acknowledgement."""

    def __init__(self, cluster: Any, *, wait_ms: int = 1000) -> None:
        self.cluster = cluster
        self.wait_ms = wait_ms
        self._replicas: dict[str, tuple[float, int]] = {}
        """Node name -> (when asked, connected replicas)."""

    async def run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        deadline = time.monotonic() + RETRY_S
        delay = 0.02
        while True:
            try:
                return await self._once(script, keys, args)
            except RETRIED:
                if time.monotonic() + delay > deadline:
                    raise
            except ResponseError as exc:
                if refused_for_memory(exc):
                    raise full_error(exc) from exc
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            await self.cluster.refresh()

    async def _once(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        node = self.cluster.get_node_from_key(keys[0])
        replicas = await self._replica_count(node)
        call = ("EVALSHA", script.sha, len(keys), *keys, *args)
        commands: list[tuple[Any, ...]] = [call]
        if replicas:
            commands.append(("WAIT", 1, self.wait_ms))
        try:
            replies = await self._send(node, commands)
        except NoScriptError:
            loaded = await self._send(node, [("SCRIPT", "LOAD", script.script), *commands])
            replies = loaded[1:]
        if not replicas:
            UNREPLICATED_WRITES.inc()
        elif int(replies[1]) < 1:
            self._replicas.pop(node.name, None)  # ask again next time
            raise NotReplicatedError(f"no replica of {node.name} acknowledged in time")
        return replies[0]

    async def _send(self, node: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` on one connection in one round trip; read every reply
        (keeping the connection in step) and raise the first error."""
        conn = node.acquire_connection()
        try:
            await conn.send_packed_command(conn.pack_commands(commands))
            replies: list[Any] = []
            error: Exception | None = None
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:
                    error = error or exc
                    replies.append(None)
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            node._free.append(conn)  # back to the node's pool of free connections
        if error is not None:
            raise error
        return replies

    async def _replica_count(self, node: Any) -> int:
        now = time.monotonic()
        known = self._replicas.get(node.name)
        if known is not None and now - known[0] < REPLICA_CHECK_S:
            return known[1]
        info = await self._send(node, [("INFO", "replication")])
        text = info[0].decode() if isinstance(info[0], bytes) else str(info[0])
        count = 0
        for line in text.splitlines():
            if line.startswith("connected_slaves:"):
                count = int(line.split(":", 1)[1])
        self._replicas[node.name] = (now, count)
        return count
