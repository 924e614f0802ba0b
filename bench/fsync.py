"""What the shipped persistence costs: fsyncs counted in Redis, and one fsync timed.

With ``appendfsync always`` Redis writes the AOF and fsyncs it (``fdatasync`` on
Linux) once per turn of its event loop, before it sends that turn's replies: every
command run in the turn waits for one disk sync, and shares it with the others
(group commit). What an event pays for durability is then one fsync's time divided
by the events one fsync covers, and a runtime that sends Redis fewer, fuller rounds
pays less per event.

``FsyncCounter`` counts the fsync system calls of the Redis process while a
measurement runs, with ``perf stat`` on the kernel's syscall tracepoints (a counter
in the kernel, no stop of Redis per call; needs root or a permissive
``perf_event_paranoid``). Without perf it counts nothing and says why.
``fsync_time`` times write + fdatasync of a small file in Redis's own directory:
what one fsync costs on this disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import summarize_ns

TWINNED = ("raw", "latency", "throughput")
"""Sections ``python -m bench`` also runs on a Redis without persistence (their result's
``unpersisted``), each against the raw limit measured on such a Redis."""
EVENTS = ("syscalls:sys_enter_fdatasync", "syscalls:sys_enter_fsync")
ATTACH_S = 0.5
"""How long ``perf stat`` is given to attach before the measured part starts."""


class FsyncCounter:
    """fsync + fdatasync calls of process ``pid`` between ``start`` and ``stop``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.proc: subprocess.Popen[bytes] | None = None
        self.out = Path(tempfile.mkstemp(prefix="duplexq-fsync-", suffix=".csv")[1])
        self.reason = ""

    def start(self) -> FsyncCounter:
        perf = shutil.which("perf")
        if perf is None:
            self.reason = "perf is not installed"
            return self
        args = [perf, "stat", "-x", ",", "-o", str(self.out), "-p", str(self.pid),
                "-e", ",".join(EVENTS)]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(ATTACH_S)
        if self.proc.poll() is not None:
            stderr = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            self.reason = f"perf stat could not count: {stderr.strip()[-200:]}"
            self.proc = None
        return self

    def stop(self) -> dict[str, Any]:
        """``{"measured": True, "fsyncs": n}``, or ``{"measured": False, "reason": ...}``."""
        if self.proc is None:
            self.out.unlink(missing_ok=True)
            return {"measured": False, "reason": self.reason}
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        text = self.out.read_text(errors="replace")
        self.out.unlink(missing_ok=True)
        total, seen = 0, 0
        for line in text.splitlines():
            cells = line.split(",")
            if len(cells) > 2 and cells[2] in EVENTS and cells[0].strip().isdigit():
                total += int(cells[0])
                seen += 1
        if seen == 0:
            return {"measured": False, "reason": f"perf stat printed no count: {text[-200:]!r}"}
        return {"measured": True, "fsyncs": total}


def per_event(counted: dict[str, Any], events: int) -> dict[str, Any]:
    """``counted`` with the events it covers and the events per fsync."""
    if not counted.get("measured") or not counted.get("fsyncs"):
        return counted
    return {**counted, "events": events,
            "events_per_fsync": round(events / counted["fsyncs"], 1)}  # fmt: skip


def fsync_time(directory: Path, samples: int = 100) -> dict[str, Any]:
    """Write 1,300 bytes (one appended event) and fdatasync, ``samples`` times, in
    ``directory`` (Redis's own): what one fsync of the AOF costs on this disk."""
    latencies = []
    fd, name = tempfile.mkstemp(prefix="fsync-probe-", dir=directory)
    try:
        for _ in range(samples):
            t0 = time.monotonic_ns()
            os.write(fd, bytes(1300))
            os.fdatasync(fd)
            latencies.append(time.monotonic_ns() - t0)
    finally:
        os.close(fd)
        os.unlink(name)
    return summarize_ns(latencies)
