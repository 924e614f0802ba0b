"""Coalesced publishing of streamed tokens, on and off, side by side in one run.

``python -m bench.coalesce`` starts a private redis-server and, in this
process, session actors of one client-facing stage holding real leases, each
served by a fake model that streams ``--tokens`` flush drafts per answer at
``--rate`` tokens/s (and, in a second pair of rows, at full speed: a yield to
the loop between tokens). Every configuration runs with coalescing on (the
settings' defaults) and off (``coalesce_ms = 0``). Per token it reports:

- publishes: publish scripts run per token;
- CPU: of this process (the actors) and of redis-server, in µs;
- latency: from the draft being yielded to the output being visible where
  the stage publishes it (the client journal: no stage reads this one), seen
  by a reader in a child process (XREAD BLOCK; ``CLOCK_MONOTONIC`` is one
  clock for both processes): p50 / p99 / max.
  The difference between the on and off rows is what coalescing adds.

Results go to ``bench/coalesce.json``. ``python -m bench --only coalesce`` runs the
same measurement as section 12 of docs/benchmarks.md (``bench/coalesce_report.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    PrivateRedis,
    cpu_seconds,
    machine_info,
    private_redis,
    python_env,
    summarize_ns,
)
from bench.common import write_json as write_results
from dataplane.authority import SessionAuthority
from dataplane.bus import Entry, RedisBus
from schemas.config import Settings, echo_pipeline
from schemas.events import (
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    TextPayload,
    decode_output,
    encode_event,
)
from schemas.fence import Fence
from schemas.keys import Keys
from workers.actor import SessionActor
from workers.backends.base import NO_HISTORY, OutputDraft, StageContext, StageEvent
from workers.ownership import StageOwnership

STAGE = "thinker"
PIPELINE = echo_pipeline(STAGE)
OUT = ROOT / "bench" / "coalesce.json"


@dataclass(frozen=True)
class Load:
    """What is streamed: ``sessions`` x ``answers`` answers of ``tokens`` tokens each."""

    sessions: int = 4
    answers: int = 10
    tokens: int = 50
    rate: float = 200.0
    """Tokens/s of the paced rows (the others stream as fast as the loop turns)."""


class StreamingModel:
    """Streams ``tokens`` flush drafts per event, stamped with when each was yielded."""

    name = "stream"
    continuous_input = False
    follows_responses = True
    rebuild = NO_HISTORY
    edits_conversation = False

    def __init__(self, tokens: int, rate: float) -> None:
        self.tokens = tokens
        self.rate = rate
        """Tokens per second; 0: as fast as the loop turns."""

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        return None

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        loop = asyncio.get_running_loop()
        begun = loop.time()
        for index in range(self.tokens):
            pause = begun + index / self.rate - loop.time() if self.rate else 0.0
            await asyncio.sleep(max(0.0, pause))
            yield OutputDraft(OutputKind.TEXT_DELTA, text=f" t{index}",
                              meta={"emitted_ns": time.monotonic_ns()}, flush=True)  # fmt: skip
        yield OutputDraft(OutputKind.DONE)

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        return None

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        return None

    async def stop(self, ctx: StageContext) -> None:
        return None

    async def aclose(self) -> None:
        return None


# -- the reader (a child process) -------------------------------------------------------


def read_outputs(url: str, streams: list[str], expected: int) -> None:
    """Print the latency (ns) of every stamped output in ``streams`` as JSON, once
    ``expected`` outputs were seen."""
    import redis

    client = redis.Redis.from_url(url)
    cursors: dict[Any, Any] = dict.fromkeys(streams, "0-0")
    print("ready", flush=True)
    latencies: list[int] = []
    seen = 0
    deadline = time.monotonic() + 300
    while seen < expected and time.monotonic() < deadline:
        reply: Any = client.xread(cursors, count=1000, block=1000)  # the sync client's reply
        arrived = time.monotonic_ns()
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                cursors[stream.decode()] = entry_id
                if b"e" not in fields:
                    continue  # a fence barrier
                seen += 1
                emitted = decode_output(fields[b"e"]).meta.get("emitted_ns")
                if isinstance(emitted, int):
                    latencies.append(arrived - emitted)
    print(json.dumps(latencies), flush=True)


def start_reader(url: str, streams: list[str], expected: int) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "bench.coalesce", "--reader", url, str(expected), *streams]
    reader = subprocess.Popen(args, cwd=ROOT, env=python_env(), stdout=subprocess.PIPE, text=True)
    assert reader.stdout is not None
    if reader.stdout.readline().strip() != "ready":
        raise RuntimeError("the reader did not start")
    return reader


# -- one configuration ---------------------------------------------------------------------


async def owned_actor(
    bus: RedisBus, ownership: StageOwnership, sid: str, backend: StreamingModel, settings: Settings
) -> SessionActor:
    await SessionAuthority(bus, PIPELINE).open(sid)
    _, lease = await ownership.acquire(sid, 0)
    assert lease is not None
    ctx = StageContext(sid, STAGE, lease.fence, {})
    return SessionActor(lease, ownership, backend, ctx, settings=settings)


async def answer_all(actor: SessionActor, answers: int) -> None:
    for seq in range(1, answers + 1):
        event = InputEvent(actor.ctx.fence, seq, seq, InputMode.APPEND_TEXT, TextPayload("go"))
        await actor.apply([Entry("in", f"{seq}-0", {b"e": encode_event(event)})])


async def run_one(
    url: str, redis_pid: int, name: str, rate: float, coalesce_ms: int, load: Load
) -> dict[str, Any]:
    settings = Settings(redis_url=url, key_prefix=name, coalesce_ms=coalesce_ms)
    bus = RedisBus(url, Keys(name))
    ownership = StageOwnership(bus, PIPELINE, STAGE, "w1", 30_000)
    calls = 0
    real_publish = ownership.publish

    async def counted(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        return await real_publish(*a, **kw)

    ownership.publish = counted  # type: ignore[method-assign]
    backend = StreamingModel(load.tokens, rate)
    try:
        actors = [
            await owned_actor(bus, ownership, f"s{i}", backend, settings)
            for i in range(load.sessions)
        ]
        # a client-facing stage that no stage reads publishes into the client journal only
        keys = [bus.keys.session(a.session_id) for a in actors]
        streams = [k.client if ownership.journal_only else k.stage_out(STAGE) for k in keys]
        tokens = load.sessions * load.answers * load.tokens
        reader = start_reader(url, streams, tokens + load.sessions * load.answers)
        calls = 0
        cpu, redis_cpu, began = time.process_time(), cpu_seconds(redis_pid), time.monotonic()
        await asyncio.gather(*(answer_all(actor, load.answers) for actor in actors))
        wall = time.monotonic() - began
        cpu, redis_cpu = time.process_time() - cpu, cpu_seconds(redis_pid) - redis_cpu
        out, _ = reader.communicate(timeout=120)
    finally:
        await bus.aclose()
    latencies = json.loads(out.strip().splitlines()[-1])
    return {
        "name": name,
        "rate": rate or "full speed",
        "coalesce_ms": coalesce_ms,
        "coalesce_max": settings.coalesce_max,
        "tokens": tokens,
        "seen": len(latencies),
        "wall_s": round(wall, 3),
        "publishes_per_token": round(calls / tokens, 3),
        "worker_cpu_us_per_token": round(1e6 * cpu / tokens, 1),
        "redis_cpu_us_per_token": round(1e6 * redis_cpu / tokens, 1),
        "latency": summarize_ns(latencies),
    }


# -- the run ---------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'stream':>11} {'coalesce':>9} {'publ/tok':>8} {'cpu us/tok':>10} "
            f"{'redis us/tok':>12} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}")  # fmt: skip
    lines = [head]
    for row in rows:
        rate = row["rate"] if isinstance(row["rate"], str) else f"{row['rate']:g} tok/s"
        mode = f"{row['coalesce_ms']} ms" if row["coalesce_ms"] else "off"
        lat = row["latency"]
        lines.append(
            f"{rate:>11} {mode:>9} {row['publishes_per_token']:>8} "
            f"{row['worker_cpu_us_per_token']:>10} {row['redis_cpu_us_per_token']:>12} "
            f"{lat['p50_ms']:>7} {lat['p99_ms']:>7} {lat['max_ms']:>7}"
        )
    return "\n".join(lines)


async def measure(server: PrivateRedis, load: Load, label: str = "") -> list[dict[str, Any]]:
    """The four rows (paced and full speed, each with the shipped coalescing and without),
    each on its own keys of ``server``."""
    default_ms = Settings().coalesce_ms
    rows = []
    for speed, rate in (("paced", load.rate), ("full", 0.0)):
        for coalesce_ms in (default_ms, 0):
            name = f"{speed}-{coalesce_ms}"
            row = await run_one(server.url, server.pid, f"{label}{name}", rate, coalesce_ms, load)
            rows.append({**row, "name": name})
    return rows


async def run(load: Load) -> dict[str, Any]:
    with private_redis("coalesce") as server:
        info = machine_info(server.version())
        rows = await measure(server, load)
    return {"machine": info, "params": asdict(load), "rows": rows, "added": added(rows)}


def added(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Latency coalescing adds per token (on minus off), per stream speed, in ms."""
    result = {}
    for on, off in zip(rows[::2], rows[1::2], strict=True):
        key = on["name"].split("-")[0]
        result[key] = {
            q: round(on["latency"][f"{q}_ms"] - off["latency"][f"{q}_ms"], 3)
            for q in ("p50", "p99")
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.coalesce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=Load.sessions, help="concurrent sessions")
    parser.add_argument("--answers", type=int, default=Load.answers, help="answers per session")
    parser.add_argument("--tokens", type=int, default=Load.tokens, help="tokens per answer")
    parser.add_argument("--rate", type=float, default=Load.rate, help="tokens/s of paced rows")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--reader", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reader:
        url, expected, *streams = args.reader
        read_outputs(url, streams, int(expected))
        return 0
    load = Load(args.sessions, args.answers, args.tokens, args.rate)
    result = asyncio.run(run(load))
    write_results(args.out, result)
    print(table(result["rows"]))
    for speed, delta in result["added"].items():
        print(f"added by coalescing ({speed}): p50 {delta['p50']} ms, p99 {delta['p99']} ms")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
