"""1. The raw limit: what the Redis operations of one hop cost, from Python and from C.

A hop is what carrying one event from one process to another takes on Redis
Streams: XADD by the sender, a blocking XREADGROUP by the receiver, XACK.
The pipeline's shortest path (coordinator -> stage -> coordinator) is two
hops, so the reference for its latency is the raw **round trip**: this
process XADDs, ``bench.raw_peer`` (another process) reads, acknowledges and
XADDs the message back, this process reads and acknowledges it. Same client
library (redis-py asyncio with hiredis), same payload (a 1,280-byte chunk,
40 ms of 16 kHz 16-bit audio), no duplexq code.

Measured here:

- ``round_trip``: one message in flight at a time; ``hop`` is the one-way
  part (XADD to the peer's XREADGROUP returning), from the same messages;
- ``unbatched``: a stream of messages, one command per message on every
  side (64 concurrent senders, one serial reader per side): the throughput
  limit of per-event commands;
- ``batched``: the same with 64-message pipelines and batch reads/acks:
  the throughput limit a batching consumer can approach;
- ``xadd_sequential`` / ``xadd_concurrent``: XADD alone from Python, one or
  64 awaited at a time (the references for accepting inputs and for a
  replay, which appends one input at a time);
- ``redis_benchmark``: redis-benchmark's XADD (C client) with one client
  unpipelined, and 50 clients pipelining 16: what the server itself allows.

On a Redis with the shipped persistence every stream also counts the fsyncs
Redis made while it ran (``fsync``: events per fsync, ``bench.fsync``), and
``fsync_time`` is one fsync timed in Redis's own directory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from typing import Any

import redis.asyncio as aioredis

from bench.common import (
    Child,
    CpuMeter,
    PrivateRedis,
    median_run,
    now_ns,
    python_env,
    summarize_ns,
)
from bench.fsync import FsyncCounter, fsync_time, per_event
from bench.raw_peer import GROUP, ensure_group

CHUNK = bytes(1280)
BATCH = 64
BATCHED_RUNS = 3
"""Runs of the batched stream; its figures are the median run's."""
PRODUCERS = 64
"""Concurrent senders of the unbatched stream: as many as the throughput benchmark's
client has (one per session)."""


def _client(url: str) -> aioredis.Redis:
    client: aioredis.Redis = aioredis.Redis.from_url(url, socket_timeout=30)
    return client


class Peer:
    """A ``bench.raw_peer`` process echoing ``inbox`` to ``outbox``."""

    def __init__(self, server: PrivateRedis, name: str, count: int, log_dir: Any) -> None:
        self.inbox = f"raw:{name}:in"
        self.outbox = f"raw:{name}:out"
        args = [sys.executable, "-m", "bench.raw_peer", server.url, self.inbox, self.outbox,
                str(count)]  # fmt: skip
        self.child = Child(f"raw-peer-{name}", args, python_env(), log_dir)

    async def start(self, client: aioredis.Redis) -> Peer:
        self.child.start()
        await ensure_group(client, self.outbox)
        for _ in range(300):
            if await client.get(f"{self.inbox}:ready"):
                return self
            await asyncio.sleep(0.05)
        self.child.kill()
        raise TimeoutError(f"raw peer did not start:\n{self.child.log()}")

    async def finish(self, client: aioredis.Redis) -> None:
        await client.xadd(self.inbox, {"stop": "1"})
        try:
            await asyncio.to_thread(self.child.proc.wait, 10)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            self.child.kill()


async def round_trip(
    server: PrivateRedis, samples: int, warmup: int, log_dir: Any
) -> dict[str, Any]:
    """One message in flight: XADD -> peer XREADGROUP/XACK/XADD -> XREADGROUP/XACK here."""
    client, reader = _client(server.url), _client(server.url)
    peer = await Peer(server, "rtt", 1, log_dir).start(client)
    rtt: list[int] = []
    hop: list[int] = []
    try:
        for i in range(warmup + samples):
            t0 = now_ns()
            await client.xadd(peer.inbox, {"t0": t0, "d": CHUNK})
            reply = await reader.xreadgroup(GROUP, "c", {peer.outbox: ">"}, count=1, block=5000)
            entry_id, fields = reply[0][1][0]
            await reader.xack(peer.outbox, GROUP, entry_id)
            t2 = now_ns()
            if i >= warmup:
                rtt.append(t2 - t0)
                hop.append(int(fields[b"t1"]) - t0)
        await peer.finish(client)
    finally:
        await client.aclose()
        await reader.aclose()
        peer.child.kill()  # no-op once it has exited
    return {"samples": samples, "round_trip": summarize_ns(rtt), "hop": summarize_ns(hop)}


async def _produce(client: aioredis.Redis, inbox: str, count: int, batch: int) -> None:
    if batch == 1:
        # One command per message, but as many in flight as the pipeline's client keeps.
        async def one_producer(share: int) -> None:
            for _ in range(share):
                await client.xadd(inbox, {"t0": now_ns(), "d": CHUNK})

        shares = [count // PRODUCERS + (i < count % PRODUCERS) for i in range(PRODUCERS)]
        await asyncio.gather(*(one_producer(n) for n in shares))
        return
    for start in range(0, count, batch):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(batch, count - start)):
            pipe.xadd(inbox, {"t0": now_ns(), "d": CHUNK})
        await pipe.execute()


async def _consume(reader: aioredis.Redis, outbox: str, count: int, batch: int) -> list[int]:
    latencies: list[int] = []
    while len(latencies) < count:
        reply = await reader.xreadgroup(GROUP, "c", {outbox: ">"}, count=batch, block=5000)
        if not reply:
            raise TimeoutError("raw stream stalled")
        messages = reply[0][1]
        if batch == 1:
            for entry_id, _ in messages:
                await reader.xack(outbox, GROUP, entry_id)
        else:
            await reader.xack(outbox, GROUP, *(entry_id for entry_id, _ in messages))
        done = now_ns()
        latencies += [done - int(fields[b"t0"]) for _, fields in messages]
    return latencies


async def stream(
    server: PrivateRedis, name: str, count: int, batch: int, log_dir: Any
) -> dict[str, Any]:
    """``count`` messages through the peer as fast as it goes: events/s end to end."""
    client, reader = _client(server.url), _client(server.url)
    peer = await Peer(server, name, batch, log_dir).start(client)
    meter = CpuMeter({"client": os.getpid(), "peer": peer.child.pid, "redis": server.pid})
    fsyncs = FsyncCounter(server.pid).start() if server.persistent else None
    try:
        meter.start()
        began = now_ns()
        _, latencies = await asyncio.gather(
            _produce(client, peer.inbox, count, batch), _consume(reader, peer.outbox, count, batch)
        )
        elapsed = (now_ns() - began) / 1e9
        cpu = meter.read()
        cpu_us = meter.per_event_us(count)
        fsynced = per_event(fsyncs.stop(), count) if fsyncs else None
        await peer.finish(client)
    finally:
        await client.aclose()
        await reader.aclose()
        peer.child.kill()  # no-op once it has exited
    return {
        "events": count,
        "batch": batch,
        "seconds": round(elapsed, 3),
        "events_per_s": round(count / elapsed, 1),
        "latency_under_load": summarize_ns(latencies),
        "cpu_percent": cpu,
        "cpu_us_per_event": cpu_us,
        **({"fsync": fsynced} if fsynced else {}),
    }


def _redis_benchmark(port: int, clients: int, pipeline: int, requests: int) -> dict[str, Any]:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return {"measured": False, "reason": "redis-benchmark is not installed"}
    args = [binary, "-h", "127.0.0.1", "-p", str(port), "-c", str(clients), "-P", str(pipeline),
            "-n", str(requests), "--csv", "XADD", f"rb:{clients}:{pipeline}", "*", "d",
            "x" * len(CHUNK)]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False).stdout
    rows = [line.replace('"', "").split(",") for line in out.strip().splitlines()]
    if len(rows) < 2:
        return {"measured": False, "reason": f"unexpected output: {out[-300:]!r}"}
    values = dict(zip(rows[0], rows[1], strict=False))
    return {
        "measured": True,
        "clients": clients,
        "pipeline": pipeline,
        "requests": requests,
        "events_per_s": float(values["rps"]),
        "p50_ms": float(values["p50_latency_ms"]),
        "p99_ms": float(values["p99_latency_ms"]),
    }


async def xadd_only(server: PrivateRedis, count: int, in_flight: int) -> dict[str, Any]:
    """XADDs alone from Python, ``in_flight`` awaited at a time: the reference for the
    coordinator accepting inputs (its append script) with no worker reading them."""
    client = _client(server.url)
    latencies: list[int] = []
    meter = CpuMeter({"client": os.getpid(), "redis": server.pid})

    async def one_sender(share: int, record: bool = True) -> None:
        for _ in range(share):
            t0 = now_ns()
            await client.xadd("raw:xadd", {"d": CHUNK})
            if record:
                latencies.append(now_ns() - t0)

    try:
        # Warm up: open the connections the timed part will use.
        await asyncio.gather(*(one_sender(5, record=False) for _ in range(in_flight)))
        meter.start()
        began = now_ns()
        shares = [count // in_flight + (i < count % in_flight) for i in range(in_flight)]
        await asyncio.gather(*(one_sender(n) for n in shares))
        elapsed = (now_ns() - began) / 1e9
    finally:
        await client.aclose()
    return {
        "events": count,
        "in_flight": in_flight,
        "events_per_s": round(count / elapsed, 1),
        "latency": summarize_ns(latencies),
        "cpu_us_per_event": meter.per_event_us(count),
    }


async def run(server: PrivateRedis, plan: Any, log_dir: Any) -> dict[str, Any]:
    """Every raw figure, on ``server`` (flushed between parts)."""
    result: dict[str, Any] = {"payload_bytes": len(CHUNK), "persistent": server.persistent}
    if server.persistent:
        result["fsync_time"] = fsync_time(server.workdir)
    result.update(await round_trip(server, plan.raw_rtt_samples, 200, log_dir))
    server.flush()
    result["unbatched"] = await stream(server, "one", plan.raw_stream_events // 4, 1, log_dir)
    server.flush()
    # The batched stream is short (about a second) and the reference of section 3's
    # ratios: its median of BATCHED_RUNS runs, with every run's rate kept.
    runs = []
    for run_index in range(BATCHED_RUNS):
        runs.append(
            await stream(server, f"batch{run_index}", plan.raw_stream_events, BATCH, log_dir)
        )
        server.flush()
    runs.sort(key=lambda run: run["events_per_s"])
    result["batched"] = {**median_run(runs, lambda run: run["events_per_s"]),
                         "runs_events_per_s": [run["events_per_s"] for run in runs]}  # fmt: skip
    result["xadd_sequential"] = await xadd_only(server, plan.raw_stream_events // 4, 1)
    server.flush()
    result["xadd_concurrent"] = await xadd_only(server, plan.raw_stream_events // 2, 64)
    server.flush()
    result["redis_benchmark"] = {
        "single_client": _redis_benchmark(server.port, 1, 1, plan.redis_benchmark_requests // 10),
        "pipelined": _redis_benchmark(server.port, 50, 16, plan.redis_benchmark_requests),
    }
    server.flush()
    return result
