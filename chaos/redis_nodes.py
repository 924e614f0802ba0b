"""The Redis a nemesis run uses: one server, or a Redis Cluster of six nodes.

Both persist as every Redis duplexq starts does (``REDIS_PERSISTENCE``). The
cluster has 3 primaries with a replica each; its ``kill_redis`` fault is a
SIGKILL of one primary, which comes back on its AOF after a pause (by then its
replica may have been promoted, and it rejoins as that one's replica). Any
primary may be killed, the first node the URL names too: the URL names three
seed nodes, as a deployment should. In cluster mode the control plane's job
queue has a plain Redis of its own (arq is not cluster-aware).
"""

from __future__ import annotations

import random
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from schemas.config import REDIS_PERSISTENCE

NODE_TIMEOUT_MS = 1000


class Process(Protocol):
    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...
    def kill(self) -> None: ...
    def terminate(self, within_s: float = 15) -> None: ...


ProcFactory = Callable[[str, list[str]], Process]
"""Makes a named child process from its command line (``chaos.cluster.Cluster._proc``)."""


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (scripts/setup installs it)")
    return found


def _server_args(port: int, data: Path, extra: list[str]) -> list[str]:
    data.mkdir(parents=True, exist_ok=True)
    return [
        _binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
        *REDIS_PERSISTENCE, "--save", "", "--maxmemory-policy", "noeviction", *extra,
    ]  # fmt: skip


class RedisNodes:
    """Start, bounce and stop the run's Redis processes."""

    def __init__(self, workdir: Path, make: ProcFactory, ports: Callable[[], int], *,
                 cluster: bool) -> None:  # fmt: skip
        self.cluster = cluster
        self.ports = [ports() for _ in range(6 if cluster else 1)]
        extra = (
            ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--repl-diskless-sync-delay", "0"]
            if cluster else []
        )  # fmt: skip
        names = [f"redis-{i}" if cluster else "redis" for i in range(len(self.ports))]
        self.nodes = [
            make(name, _server_args(port, workdir / name, extra))
            for name, port in zip(names, self.ports, strict=True)
        ]
        self.queue_port = ports()
        self.queue = (
            make("redis-queue", _server_args(self.queue_port, workdir / "redis-queue", []))
            if cluster else None
        )  # fmt: skip

    @property
    def url(self) -> str:
        if not self.cluster:
            return f"redis://127.0.0.1:{self.ports[0]}/0"
        # Several seeds: a process (re)started while a killed node is down still
        # reaches the cluster.
        seeds = ",".join(f"127.0.0.1:{port}" for port in self.ports[:3])
        return f"redis+cluster://{seeds}/0"

    @property
    def queue_url(self) -> str:
        return f"redis://127.0.0.1:{self.queue_port}/0" if self.queue is not None else ""

    def start(self, wait_port: Callable[[int, float], None]) -> None:
        for node in [*self.nodes, *([self.queue] if self.queue else [])]:
            node.start()
        for port in self.ports:
            wait_port(port, 10)
        if self.queue is not None:
            wait_port(self.queue_port, 10)
        if self.cluster:
            subprocess.run(
                [_binary("redis-cli"), "--cluster", "create",
                 *(f"127.0.0.1:{port}" for port in self.ports),
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            self._wait_ok(60)

    def _wait_ok(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if all(self._ok(port) for port in self.ports):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the Redis Cluster is not ok after {within_s} s")

    @staticmethod
    def _cli(port: int, *args: str) -> str:
        command = [_binary("redis-cli"), "-p", str(port), *args]
        return subprocess.run(command, check=False, capture_output=True, text=True).stdout

    def _ok(self, port: int) -> bool:
        info = self._cli(port, "cluster", "info")
        repl = self._cli(port, "info", "replication")
        if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
            return False
        return "role:slave" not in repl or "master_link_status:up" in repl

    def bounce(self, rng: random.Random, down_s: float) -> str:
        """SIGKILL one Redis (on a cluster: a primary) and start it again after
        ``down_s``; returns which."""
        index = 0
        if self.cluster:
            primaries = [i for i in range(len(self.nodes)) if self._role(i) == "master"]
            index = rng.choice(primaries or list(range(len(self.nodes))))
        node = self.nodes[index]
        node.kill()
        time.sleep(down_s)
        node.start()
        return f"redis-{index}" if self.cluster else "redis"

    def _role(self, index: int) -> str:
        for line in self._cli(self.ports[index], "info", "replication").splitlines():
            if line.startswith("role:"):
                return line.split(":", 1)[1].strip()
        return "down"

    def heal(self) -> None:
        for node in self.nodes:
            if not node.alive:
                node.start()

    def stop(self) -> None:
        for node in [*self.nodes, *([self.queue] if self.queue else [])]:
            node.terminate(15)
