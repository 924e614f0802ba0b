"""What every benchmark shares: a private redis-server, child processes, statistics.

Each benchmark starts its own ``redis-server`` on a free port with its data in
a temporary directory on the machine's disk, so nothing else on the machine (a
Redis on 6379, another engineer's tests) shares its server. It persists as the
product ships (``REDIS_PERSISTENCE``: AOF, fsynced before every reply) unless a
twin without persistence is asked for, to show what the fsync costs. Worker processes
are plain ``python -m workers`` children configured through the ``DUPLEXQ_*``
environment, as an operator would start them.

Times are ``time.monotonic_ns()`` (Linux ``CLOCK_MONOTONIC``), which is one
clock for every process on the machine: a stamp taken in one process can be
subtracted from a reading in another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from schemas.config import REDIS_PERSISTENCE, PipelineConfig, Settings

ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def now_ns() -> int:
    return time.monotonic_ns()


def ms(ns: float) -> float:
    return ns / 1e6


# -- statistics -----------------------------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (``q`` in 0..100)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def summarize_ns(samples: Sequence[int]) -> dict[str, float]:
    """Count, p50, p99, mean and max of nanosecond samples, in milliseconds."""
    ordered = sorted(samples)
    if not ordered:
        return {"count": 0, "p50_ms": math.nan, "p99_ms": math.nan, "mean_ms": math.nan,
                "max_ms": math.nan}  # fmt: skip
    return {
        "count": len(ordered),
        "p50_ms": round(ms(percentile(ordered, 50)), 3),
        "p99_ms": round(ms(percentile(ordered, 99)), 3),
        "mean_ms": round(ms(sum(ordered) / len(ordered)), 3),
        "max_ms": round(ms(ordered[-1]), 3),
    }


def ratio(value: float, reference: float) -> float:
    """``value / reference`` rounded for a table; NaN when either is missing."""
    if not reference or math.isnan(reference) or math.isnan(value):
        return math.nan
    return round(value / reference, 3)


_Run = TypeVar("_Run")


def median_run(runs: Sequence[_Run], key: Callable[[_Run], float]) -> _Run:
    """The run in the middle when ordered by ``key`` (the lower one of an even count): a
    figure that one stall of a shared machine moves in one run only."""
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


# -- the private redis-server -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class BenchRedis(Protocol):
    """What a measurement needs of its Redis: one server or a cluster."""

    @property
    def url(self) -> str: ...
    @property
    def pids(self) -> dict[str, int]: ...
    @property
    def persistent(self) -> bool: ...
    def flush(self) -> None: ...


class PrivateRedis:
    """One redis-server of a benchmark: own port, own temp dir; the shipped persistence
    (``REDIS_PERSISTENCE``) unless ``persistent`` is False (AOF off)."""

    def __init__(
        self, workdir: Path, extra: list[str] | None = None, *, persistent: bool = True
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup installs it)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.extra = extra or []
        """More redis-server options (a cluster node's)."""
        self._persistent = persistent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.workdir), "--save", "",
            *(REDIS_PERSISTENCE if self._persistent else ("--appendonly", "no")),
            "--maxmemory-policy", "noeviction", "--logfile", str(self.workdir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited early; see {self.workdir / 'redis.log'}")
            if self.command(b"PING").startswith(b"+PONG"):
                return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start within 10 s")

    def command(self, *parts: bytes) -> bytes:
        """Send one command (RESP array) and return the raw reply; b"" when unreachable."""
        payload = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
                sock.sendall(payload)
                return sock.recv(65536)
        except OSError:
            return b""

    def flush(self) -> None:
        self.command(b"FLUSHALL")

    def version(self) -> str:
        info = self.command(b"INFO", b"server").decode(errors="replace")
        for line in info.splitlines():
            if line.startswith("redis_version:"):
                return line.split(":", 1)[1].strip()
        return "unknown"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def pids(self) -> dict[str, int]:
        """The Redis processes whose CPU a benchmark counts."""
        return {"redis": self.pid}

    @property
    def persistent(self) -> bool:
        """Whether it runs the shipped persistence (AOF, fsync before every reply)."""
        return self._persistent

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def private_redis(name: str, *, persistent: bool = True) -> Iterator[PrivateRedis]:
    """A started redis-server in a fresh temp dir, stopped (and the dir removed) after; the
    shipped persistence unless ``persistent`` is False."""
    workdir = Path(tempfile.mkdtemp(prefix=f"duplexq-bench-{name}-"))
    server = PrivateRedis(workdir / "redis", persistent=persistent)
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# -- child processes ------------------------------------------------------------------------


def cpu_times(pid: int) -> tuple[float, float] | None:
    """The user and the system CPU seconds a process has used (None when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (0 when it is gone)."""
    return sum(cpu_times(pid) or (0.0,))


@dataclass
class CpuMeter:
    """CPU used by named processes over an interval, as a % of one core."""

    pids: dict[str, int]
    started: float = 0.0
    base: dict[str, float] = field(default_factory=dict)

    def start(self) -> CpuMeter:
        self.started = time.monotonic()
        self.base = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        return self

    def used(self) -> dict[str, float]:
        """CPU seconds each process used since ``start``."""
        return {name: cpu_seconds(pid) - self.base[name] for name, pid in self.pids.items()}

    def read(self) -> dict[str, float]:
        elapsed = max(1e-9, time.monotonic() - self.started)
        return {name: round(100 * used / elapsed, 1) for name, used in self.used().items()}

    def per_event_us(self, events: int) -> dict[str, float]:
        """CPU microseconds each process spent per event (machine load does not inflate
        this much, unlike latency: a figure to compare across runs)."""
        per = {name: round(1e6 * used / max(1, events), 1) for name, used in self.used().items()}
        per["total"] = round(sum(per.values()), 1)
        return per


def cpu_of(cpu: dict[str, float], kind: str) -> float:
    """The share of a ``per_event_us`` figure spent in the processes named ``kind...``:
    ``worker`` (every worker process) or ``redis`` (every Redis node)."""
    return sum(v for k, v in cpu.items() if k.startswith(kind))


class Child:
    """A child process with its output in a log file; ended only by its own pid."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def pids(self) -> dict[str, int]:
        """The Redis processes whose CPU a benchmark counts."""
        return {"redis": self.pid}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (what a crash looks like) and reap."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``timeout``."""
        if not self.alive():
            return
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class WorkerPool:
    """``python -m workers`` processes for one stage of a pipeline."""

    def __init__(self, settings: Settings, pipeline: PipelineConfig, stage: str, log_dir: Path):
        self.settings = settings
        self.stage = stage
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.pipeline_path = log_dir / f"pipeline-{pipeline.name}.json"
        self.pipeline_path.write_text(pipeline.model_dump_json())
        self.children: list[Child] = []

    def spawn(self, worker_id: str, module: str = "workers", extra: list[str] | None = None,
              env: dict[str, str] | None = None) -> Child:  # fmt: skip
        args = [
            sys.executable, "-m", module, "--stage", self.stage,
            "--pipeline", str(self.pipeline_path), "--worker-id", worker_id,
            "--log-level", "WARNING", *(extra or []),
        ]  # fmt: skip
        child = Child(worker_id, args, python_env({**self.settings.to_env(), **(env or {})}),
                      self.log_dir).start()  # fmt: skip
        self.children.append(child)
        return child

    def start(self, count: int, prefix: str = "w") -> list[Child]:
        return [self.spawn(f"{prefix}{i + 1}") for i in range(count)]

    def stop_all(self, *, kill: bool = True, grace_s: float = 30) -> None:
        """End every worker this pool started: SIGKILL by default (the data is flushed
        next), else SIGTERM with ``grace_s`` to shut down (a vLLM engine takes seconds)."""
        for child in self.children:
            child.kill() if kill else child.stop(grace_s)
        self.children.clear()


async def wait_workers(bus: Any, stage: str, count: int, limit_s: float = 30.0) -> None:
    """Wait until ``count`` workers of ``stage`` have sent a heartbeat."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if int(await bus.client.zcard(bus.keys.workers(stage))) >= count:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{count} {stage} worker(s) did not start within {limit_s} s")


def bench_settings(server: BenchRedis, prefix: str, **overrides: Any) -> Settings:
    """Product defaults, pointed at the private server, with a benchmark's overrides.

    On a server without persistence (the twin that shows what the fsync costs),
    ``redis_durability`` is relaxed: a worker checking its Redis at start would otherwise
    refuse it. On the shipped persistence nothing is relaxed."""
    values: dict[str, Any] = {"redis_url": server.url, "key_prefix": prefix}
    if not server.persistent:
        values["redis_durability"] = "relaxed"
    return Settings.model_validate({**values, **overrides})


# -- the machine ------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    return math.nan


def machine_info(redis_version: str) -> dict[str, Any]:
    import redis as redis_py

    return {
        "cpu_model": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "redis_server": redis_version,
        "redis_py": redis_py.__version__,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
