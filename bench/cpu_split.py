"""Where each process's CPU per event goes, one Redis against the cluster: user and
system time, and how often it was switched out.

``python -m bench.cpu_split [--pairs 2]``: section 10's saturated point (one echo
worker, the full plan's 64 sessions and window of 512) on a private Redis, then on a
private cluster of 3 primaries with a replica each, the shipped persistence on every
server, one Redis first in each pair. For every process it prints, per event sent:
user and system CPU (µs, from ``/proc/PID/stat``), and voluntary and involuntary
context switches (``/proc/PID/status``: a process that blocked, one that was
preempted while it could run). docs/scaling.md quotes the figures: the coordinator's
and the worker's extra CPU on a cluster is user time, spent while they are preempted
ten times as often. Not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import BenchRedis, cpu_times, private_redis
from bench.load import saturate
from bench.plan import FULL
from bench.primaries import private_cluster
from bench.rig import echo_rig


def counters(pid: int) -> dict[str, float]:
    """A process's user and system CPU seconds and its context switches so far."""
    times = cpu_times(pid)
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    if times is None:
        return {}
    out = {"user": times[0], "system": times[1]}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            out[name.split("_")[0]] = float(value)
    return out


@dataclass
class SplitMeter:
    """Each named process's counters over an interval."""

    pids: dict[str, int]
    base: dict[str, dict[str, float]] = field(default_factory=dict)

    def start(self) -> SplitMeter:
        self.base = {name: counters(pid) for name, pid in self.pids.items()}
        return self

    def per_event(self, events: int) -> dict[str, dict[str, float]]:
        """Per process: user and system µs, and switches, per event."""
        out: dict[str, dict[str, float]] = {}
        for name, pid in self.pids.items():
            now, then = counters(pid), self.base[name]
            out[name] = {k: (now[k] - then[k]) / max(1, events) for k in now if k in then}
            for k in ("user", "system"):
                out[name][k] *= 1e6
        return out


async def point(server: BenchRedis, name: str) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="duplexq-bench-split-"))
    async with echo_rig(server, log_dir, name=name, workers=1,
                        sessions=FULL.throughput_sessions) as rig:  # fmt: skip
        meter = SplitMeter(rig.cpu_meter().pids).start()
        result = await saturate(
            rig.coordinator, rig.collector, rig.session_ids, seconds=FULL.throughput_seconds,
            warmup=FULL.warmup_seconds, window=FULL.throughput_window,
        )  # fmt: skip
        result["split"] = meter.per_event(result["sent"])
    return result


def show(where: str, result: dict[str, Any]) -> None:
    split = result["split"]
    total = sum(p["user"] + p["system"] for p in split.values())
    print(f"  {where}: {result['events_per_s']:.0f} ev/s, {total:.0f} us CPU per event")
    for name, p in split.items():
        print(f"    {name:20s} user {p['user']:6.1f} us, system {p['system']:5.1f} us, "
              f"switches {p.get('voluntary', 0):.3f} blocked / "
              f"{p.get('nonvoluntary', 0):.3f} preempted per event")  # fmt: skip


async def run(pairs: int) -> None:
    for at in range(pairs):
        print(f"pair {at}:", flush=True)
        with private_redis(f"split{at}") as redis:
            one = await point(redis, f"one{at}")
        with private_cluster() as cluster:
            many = await point(cluster, f"clu{at}")
        show("one Redis", one)
        show("cluster", many)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    asyncio.run(run(parser.parse_args().pairs))


if __name__ == "__main__":
    main()
