"""Lanes to each node of a cluster for script batches, one per batch in flight.

A script batch on a cluster ends with ``WAIT 1`` (``dataplane.replicated``), which
holds its connection until the replica answered: so each batch in flight has a lane
of its own, taken from its node's pool as a connection from a pool, and given back
once answered. Lanes to a node that no longer serves as a primary (a failover
demoted it, or it left the cluster) are closed once the slot map is learnt again:
they were otherwise kept for as long as the process ran, each with its socket open
where the node lives on (``tests/test_cluster_lanes.py``).
"""

from __future__ import annotations

from typing import Any

from dataplane.lane import Lane
from dataplane.node_lanes import NodeLanes


class LanePool:
    """Each node's lanes with no batch in flight, made by ``lanes`` when all are busy."""

    def __init__(self, cluster: Any, lanes: NodeLanes) -> None:
        self.lanes = lanes
        self._free: dict[str, list[Lane]] = {}
        """Node name -> its lanes with no batch in flight."""
        self._all: list[Lane] = []
        self._serving: frozenset[str] | None = None
        """The primaries' names as of the slot map learnt last (None: not known yet)."""
        cluster.relearned.append(self.prune)

    def take(self, node: Any) -> Lane:
        """A lane to ``node`` with no batch in flight (a new one when all are busy; one
        whose connection was lost connects again when next used)."""
        free = self._free.get(node.name)
        if free:
            return free.pop()
        lane = self.lanes.new_lane(node)
        self._all.append(lane)
        return lane

    def give_back(self, name: str, lane: Lane) -> None:
        """Put a lane whose batch was answered back in its node's pool, or close it if
        that node no longer serves as a primary."""
        if self._serving is None or name in self._serving:
            self._free.setdefault(name, []).append(lane)
        else:
            self._drop(lane)

    @property
    def open(self) -> list[Lane]:
        """Every lane made and not yet closed, idle or with a batch in flight."""
        return list(self._all)

    def idle(self, name: str) -> list[Lane]:
        """The node's lanes with no batch in flight."""
        return list(self._free.get(name, ()))

    def prune(self, serving: frozenset[str]) -> None:
        """The slot map was learnt again, ``serving`` its primaries: close the idle lanes
        to other nodes; a lane with a batch in flight goes when answered."""
        self._serving = serving
        for name in [name for name in self._free if name not in serving]:
            for lane in self._free.pop(name):
                self._drop(lane)

    def _drop(self, lane: Lane) -> None:
        if lane in self._all:  # not yet let go by ``aclose``
            self._all.remove(lane)
        lane.close()

    async def aclose(self) -> None:
        lanes, self._all, self._free = self._all, [], {}
        for lane in lanes:
            await lane.aclose()
