"""How many replicas a cluster primary has: whether its script batches wait for one.

A batch sent to a primary with a replica ends with ``WAIT 1`` (``dataplane.replicated``);
one sent to a primary without any is acknowledged on its own (and counted as
unreplicated). The count comes from ``INFO replication`` (``connected_slaves``), asked
at most once per ``REPLICA_CHECK_S`` per node.

An application's ACL user is often refused ``INFO`` (``-@dangerous``, as managed Redis
services and ``docs/deploy.md`` suggest). Then the count comes from the primary's own
``CLUSTER NODES``: its replicas that it does not see down (``fail``, ``fail?``...), and,
once a ``WAIT`` went unanswered, that it is still linked to. A replica's death unlinks
it at once, as it drops out of INFO's count; its ``fail`` flag comes only after the
cluster's node timeout (15 s by default), and a write waiting that long was close to
failing (``RETRY_S``). A live replica's link can break and come back while it
replicates on (a busy node's missed ``PONG``): that alone, with its ``WAIT``s answered,
does not make its primary acknowledge without it. So a replica that dies costs a
batch one unanswered ``WAIT`` (then retried, ``NotReplicatedError``), as when a replica
dies between two INFO checks (``tests/test_cluster_acl.py``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import NoPermissionError

from dataplane.cluster_nodes import live_replicas

REPLICA_CHECK_S = 1.0
"""How long a primary's replica count is trusted before it is asked again."""

Send = Callable[[Any, list[tuple[Any, ...]]], Awaitable[list[Any]]]
"""Sends commands to a node and returns their replies (an error reply raised)."""


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def connected_replicas(info: str) -> int:
    """``connected_slaves`` from the text of ``INFO replication``."""
    for line in info.splitlines():
        if line.startswith("connected_slaves:"):
            return int(line.split(":", 1)[1])
    return 0


class ReplicaCounts:
    """Each primary's replica count, asked again once ``REPLICA_CHECK_S`` old."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._known: dict[str, tuple[float, int]] = {}
        """Node name -> (when asked, its replicas)."""
        self.info_refused = False
        """``INFO`` was refused (an ACL user): ``CLUSTER NODES`` is asked instead."""
        self._unanswered: set[str] = set()
        """Nodes whose replica did not acknowledge a ``WAIT`` since they were last asked:
        counted from ``CLUSTER NODES``, a replica they are not linked to no longer counts
        for them."""

    async def of(self, node: Any) -> int:
        now = time.monotonic()
        known = self._known.get(node.name)
        if known is not None and now - known[0] < REPLICA_CHECK_S:
            return known[1]
        count = await self._ask(node)
        self._known[node.name] = (now, count)
        return count

    def forget(self, node: Any) -> None:
        """Ask ``node`` again next time (its replica did not acknowledge)."""
        self._known.pop(node.name, None)
        self._unanswered.add(node.name)

    async def _ask(self, node: Any) -> int:
        unanswered = node.name in self._unanswered
        self._unanswered.discard(node.name)
        if not self.info_refused:
            try:
                (info,) = await self._send(node, [("INFO", "replication")])
            except NoPermissionError:
                self.info_refused = True
            else:
                return connected_replicas(_text(info))
        (nodes,) = await self._send(node, [("CLUSTER", "NODES")])
        return live_replicas(_text(nodes), linked=unanswered)
