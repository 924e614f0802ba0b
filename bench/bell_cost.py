"""What following its bells costs a process per ring on a cluster: a lane against redis-py.

``python -m bench.bell_cost [--rings 40000] [--rounds 3]``: a cluster-mode Redis of one
node serving every slot, and a reader following one consumer's bells
(``dataplane.bell_channels``), over lanes (a plain-TCP cluster, as shipped: each message
handled in the connection's data callback) and over redis-py's connections (as on a TLS
cluster: an awaited read per message), in turn, each round. Another process publishes
``--rings`` rings to one of the bells, ``BURST`` at a time, one burst per millisecond at
most; the figure is the reader's CPU (this process's) per ring heard, from the first
ring to the last. docs/scaling.md quotes it. Not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from typing import Any

import hiredis
import msgspec

from bench.cluster_parts import one_node_cluster
from dataplane.bell_channels import ChannelBells
from dataplane.bus import RedisBus
from schemas.keys import Keys

BURST = 16
"""Rings published together (a script batch rings a bell once; several batches land
between two reads of a busy reader)."""

RING = b"d" + msgspec.msgpack.encode(["session-1"])
"""One ring of one session's data, as the scripts send it."""


async def follow(url: str, rings: int, *, lanes: bool) -> float:
    """CPU seconds per ring of a reader over lanes or redis-py's connections, while
    another process publishes ``rings`` rings."""
    bus = RedisBus(url, Keys("bellcost"))
    heard = 0
    first = 0.0
    done = asyncio.Event()

    def on_ring(session_id: str, kind: str) -> None:
        nonlocal heard, first
        if not heard:
            first = time.process_time()
        heard += 1
        if heard == rings:
            done.set()

    started = asyncio.Event()
    bells = bus.keys.bells("w1")
    reader = ChannelBells(
        bus.client, bells, on_ring, lambda: None, started, idle_s=0.5,
        running=lambda: not done.is_set(), lanes=bus.node_lanes if lanes else None,
    )  # fmt: skip
    task = asyncio.create_task(reader.run())
    try:
        await started.wait()
        port = url.rsplit(":", 1)[1]
        publisher = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.bell_cost", "--publish", port, bells[0], str(rings)
        )
        async with asyncio.timeout(120):
            await done.wait()
        cpu = time.process_time() - first
        await publisher.wait()
        await task
    finally:
        task.cancel()
        await bus.aclose()
    return cpu / rings


def publish(port: int, channel: str, rings: int) -> None:
    """Publish ``rings`` rings to ``channel``, ``BURST`` per write, reading the replies."""
    reader = hiredis.Reader()
    command: tuple[Any, ...] = ("SPUBLISH", channel, RING)
    burst = hiredis.pack_command(command) * BURST
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(0, rings, BURST):
            conn.sendall(burst)
            answered = 0
            while answered < BURST:
                reader.feed(conn.recv(65536))
                while reader.gets() is not False:
                    answered += 1
            time.sleep(0.001)


async def run(rings: int, rounds: int) -> None:
    with one_node_cluster(replica=False) as cluster:
        for index in range(rounds):
            lane = await follow(cluster.url, rings, lanes=True)
            redis_py = await follow(cluster.url, rings, lanes=False)
            print(f"round {index}: CPU per ring {lane * 1e6:.1f} us over a lane, "
                  f"{redis_py * 1e6:.1f} us over redis-py ({redis_py / lane:.1f}x)",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rings", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--publish", nargs=3, metavar=("PORT", "CHANNEL", "RINGS"))
    args = parser.parse_args()
    if args.publish:
        port, channel, rings = args.publish
        publish(int(port), channel, int(rings))
        return
    asyncio.run(run(args.rings, args.rounds))


if __name__ == "__main__":
    main()
