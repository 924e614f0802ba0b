"""Where a cluster's CPU per event goes: one Redis, one cluster node, a node with its
replica, and 3 primaries with replicas, side by side.

``python -m bench.cluster_parts [--rounds 2] [--seconds 8]``: section 10's saturated
point (one echo worker, the full plan's 64 sessions and window of 512) on four data
planes in turn, each round in this order, every server with the shipped persistence:

- ``one Redis``: the shipped single Redis;
- ``1 node``: a cluster-mode Redis serving every slot, no replica: the data plane's
  cluster paths (shard-channel bells, reads per slot, the cross-slot script form)
  without replication. A primary without a replica acknowledges what one failure can
  lose, so the product runs on it only with ``redis_durability`` relaxed, as here;
- ``1 node + replica``: the same node with a replica, every script batch closed by
  ``WAIT 1`` (``dataplane.replicated``): what replication adds;
- ``3 primaries + replicas``: the shipped cluster of section 10: what spreading the
  slots over three primaries (six nodes on the machine's cores) adds.

CPU per event over every process, and each plane's ratio to the round's one Redis.
docs/scaling.md quotes the figures. Not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import PrivateRedis, private_redis
from bench.plan import FULL
from bench.primaries import PrivateCluster, private_cluster
from bench.throughput import saturated


class OneNodeCluster(PrivateCluster):
    """A cluster-mode Redis serving all 16384 slots, with a replica or without."""

    def __init__(self, workdir: Path, *, replica: bool) -> None:
        super().__init__(workdir, nodes=2 if replica else 1)

    def start(self) -> OneNodeCluster:
        for node in self.nodes:
            node.start()
        primary = self.nodes[0]
        primary.command(b"CLUSTER", b"ADDSLOTSRANGE", b"0", b"16383")
        if len(self.nodes) > 1:
            self._attach(primary, self.nodes[1])
        self.wait_ok()
        return self

    @staticmethod
    def _attach(primary: PrivateRedis, replica: PrivateRedis) -> None:
        """Make ``replica`` a replica of ``primary``, once it has learnt of it."""
        primary_id = primary.command(b"CLUSTER", b"MYID").split(b"\r\n")[1]
        replica.command(b"CLUSTER", b"MEET", b"127.0.0.1", str(primary.port).encode())
        deadline = time.monotonic() + 30
        while not replica.command(b"CLUSTER", b"REPLICATE", primary_id).startswith(b"+OK"):
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not join the one-node cluster in 30 s")
            time.sleep(0.1)
        while b"master_link_status:up" not in replica.command(b"INFO", b"replication"):
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not sync with its primary in 30 s")
            time.sleep(0.1)


@contextlib.contextmanager
def one_node_cluster(*, replica: bool) -> Iterator[OneNodeCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="duplexq-bench-one-node-"))
    cluster = OneNodeCluster(workdir, replica=replica)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


PLANES: list[tuple[str, Any, dict[str, Any]]] = [
    ("one Redis", lambda: private_redis("parts"), {}),
    ("1 node", lambda: one_node_cluster(replica=False), {"redis_durability": "relaxed"}),
    ("1 node + replica", lambda: one_node_cluster(replica=True), {}),
    ("3 primaries + replicas", private_cluster, {}),
]
"""Each data plane: its name, a context manager of its servers, settings it needs."""


def line(name: str, point: dict[str, Any], base: float) -> str:
    cpu = point["cpu_us_per_event"]
    each = ", ".join(f"{k} {v:.0f}" for k, v in cpu.items() if k != "total")
    return (f"  {name}: {point['events_per_s']:,.0f} ev/s, CPU {cpu['total']:.0f} us per "
            f"event ({cpu['total'] / base:.2f}x one Redis): {each}")  # fmt: skip


async def run(rounds: int, seconds: float) -> None:
    plan = dataclasses.replace(FULL, throughput_seconds=seconds)
    logs = Path(tempfile.mkdtemp(prefix="duplexq-bench-parts-"))
    for index in range(rounds):
        print(f"round {index}:", flush=True)
        base = 0.0
        for number, (name, servers, overrides) in enumerate(PLANES):
            with servers() as server:
                point = await saturated(server, logs, f"p{index}x{number}", 1, plan, **overrides)
            base = base or point["cpu_us_per_event"]["total"]
            print(line(name, point, base), flush=True)
    shutil.rmtree(logs, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    asyncio.run(run(args.rounds, args.seconds))


if __name__ == "__main__":
    main()
