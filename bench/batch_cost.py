"""What one script batch costs each party on a primary with a replica: fsync and WAIT.

``python -m bench.batch_cost [--batches 3000] [--rounds 2]``: a cluster-mode Redis
serving every slot, with a replica (``bench.cluster_parts``), and a client sending
batches of ``CALLS`` writes over one connection in a closed loop (the next batch once
the last is answered), four ways in turn: with ``appendfsync always`` (shipped) and
``no`` (set on both servers for the measurement), each with and without ``WAIT 1``
closing the batch. CPU per batch of the primary, the replica and the client (this
process, a bare socket and hiredis). docs/scaling.md quotes it. Not part of
``python -m bench``.
"""

from __future__ import annotations

import argparse
import socket
import time
from typing import Any

import hiredis

from bench.cluster_parts import one_node_cluster
from bench.common import PrivateRedis, cpu_seconds

CALLS = 10
"""Writes per batch: about what a primary's batch carries at section 10's point."""

VALUE = b"v" * 40


def batches(port: int, count: int, *, wait: bool) -> None:
    """Send ``count`` batches to ``port``, each answered before the next is sent."""
    reader = hiredis.Reader()
    commands: list[tuple[Any, ...]] = [("HSET", f"k{i}", "f", VALUE) for i in range(CALLS)]
    if wait:
        commands.append(("WAIT", 1, 1000))
    batch = b"".join(hiredis.pack_command(command) for command in commands)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(count):
            conn.sendall(batch)
            answered = 0
            while answered < len(commands):
                reader.feed(conn.recv(65536))
                while reader.gets() is not False:
                    answered += 1


def measure(primary: PrivateRedis, replica: PrivateRedis, count: int, wait: bool) -> str:
    before = (cpu_seconds(primary.pid), cpu_seconds(replica.pid), time.process_time())
    batches(primary.port, count, wait=wait)
    after = (cpu_seconds(primary.pid), cpu_seconds(replica.pid), time.process_time())
    each = [(b - a) * 1e6 / count for a, b in zip(before, after, strict=True)]
    return (f"primary {each[0]:.0f}, replica {each[1]:.0f}, client {each[2]:.0f}, "
            f"all {sum(each):.0f} us per batch")  # fmt: skip


def run(count: int, rounds: int) -> None:
    with one_node_cluster(replica=True) as cluster:
        primary, replica = cluster.nodes
        for index in range(rounds):
            for fsync in ("always", "no"):
                for node in cluster.nodes:
                    node.command(b"CONFIG", b"SET", b"appendfsync", fsync.encode())
                for wait in (False, True):
                    what = "with WAIT 1" if wait else "no WAIT"
                    print(f"round {index}, appendfsync {fsync}, {what}: "
                          f"{measure(primary, replica, count, wait)}", flush=True)  # fmt: skip
            for node in cluster.nodes:
                node.command(b"CONFIG", b"SET", b"appendfsync", b"always")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    run(args.batches, args.rounds)


if __name__ == "__main__":
    main()
