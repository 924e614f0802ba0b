"""The processes under test, started as a deployment runs them: each a real process.

A private Redis with the product's persistence (``REDIS_PERSISTENCE``): one
server, or a Redis Cluster of six nodes (``chaos.redis_nodes``); the control
plane, coordinators on their own ports and stage workers, all with
the shipped settings but for the Redis URL, the key prefix and the API key.
Each process can be killed with SIGKILL, stopped with SIGSTOP, continued and
started again (Redis on its AOF, a coordinator on its port, a worker under a
new id). Each of them but Redis reaches the data plane's Redis through a route
of its own (``chaos.proxy``), which the nemesis can cut or slow down.

With ``hosts`` (the ``--hosts`` mode, on a Redis Cluster) every process runs on
a simulated host (``chaos.hosts``: a network namespace with its own address)
placed by ``chaos.hosts.place``, and reaches Redis directly on the hosts'
addresses: no routes; the nemesis partitions hosts instead.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos.hosts import Hosts, place
from chaos.proxy import Proxies, Route
from chaos.redis_nodes import LOCAL, RedisNodes
from schemas.config import PipelineConfig, Settings

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


BUS_OFFSET = 10_000
"""A cluster node's bus listens on its port + 10000."""

_handed_out: set[int] = set()
"""Ports (and bus ports) ``cluster_port`` gave this process: the nodes of one cluster
are given ports before any of them starts, so one's bus port must not be another's."""


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel picks outgoing connections' local ports from."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too, both below the
    ephemeral range where the kernel can (an outgoing connection's local port would
    take one between this choice and the node's start), and neither given out before."""
    low, _ = ephemeral_range()
    below = range(10_000, low - BUS_OFFSET) if low - BUS_OFFSET > 12_000 else None
    for _ in range(500):
        port = random.choice(below) if below else free_port()
        pair = {port, port + BUS_OFFSET}
        if port + BUS_OFFSET > 65_535 or pair & _handed_out:
            continue
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            _handed_out.update(pair)
            return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_port(host: str, port: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {host}:{port} after {within_s} s")


@dataclass
class Proc:
    """One child process and how to start it again."""

    name: str
    args: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    stopped: bool = False

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.stopped = False

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive and self.popen is not None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(10)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.stopped = False

    def terminate(self, within_s: float = 15) -> None:
        if not self.alive or self.popen is None:
            return
        self.resume()
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(within_s)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Cluster:
    """Redis, the control plane, coordinators and workers of one nemesis run."""

    workdir: Path
    pipeline: PipelineConfig
    coordinators: int = 2
    workers_per_stage: int = 2
    api_key: str = "nemesis"
    redis_cluster: bool = False
    """Run on a Redis Cluster (3 primaries, 3 replicas) instead of one Redis."""
    hosts: Hosts | None = None
    """Simulated hosts the processes run on (opened by ``start``, closed by ``stop``);
    None: every process on this machine's loopback, through its route."""
    placed: dict[str, int] = field(default_factory=dict)
    """Process name -> the host it runs on (with ``hosts``)."""
    redis: RedisNodes = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    settings: Settings = field(init=False)
    proxies: Proxies | None = None
    """Each process's route to the data plane's Redis (opened by ``start``)."""
    _spawned: int = 0

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        ports = cluster_port if self.redis_cluster else free_port
        self.redis = RedisNodes(self.workdir, self._bare, ports, cluster=self.redis_cluster,
                                place=self.address)  # fmt: skip
        self.settings = Settings().model_copy(
            update={
                "redis_url": self.redis.url,
                "control_redis_url": self.redis.queue_url,
                "key_prefix": "nemesis",
                "api_keys": (self.api_key,),
            }
        )
        self.pipeline_path = self.workdir / "pipeline.json"
        self.pipeline_path.write_text(self.pipeline.model_dump_json())

    def address(self, name: str) -> str:
        """The address process ``name`` listens on: its host's, or loopback."""
        if self.hosts is None:
            return LOCAL
        index = self.placed.setdefault(name, place(name, self._spawned))
        return self.hosts.address(index)

    def _on_host(self, name: str, args: list[str]) -> list[str]:
        if self.hosts is None:
            return args
        self.address(name)  # placed
        return self.hosts.command(self.placed[name], args)

    def _bare(self, name: str, args: list[str]) -> Proc:
        log = self.workdir / "logs" / f"{name}.log"
        return Proc(name, self._on_host(name, args), log, dict(os.environ))

    def _proc(self, name: str, args: list[str]) -> Proc:
        settings = self.settings.model_copy(update={"redis_url": self._routed_url(name)})
        env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(ROOT)}
        return Proc(name, self._on_host(name, args), self.workdir / "logs" / f"{name}.log", env)

    def _routed_url(self, name: str) -> str:
        """The data plane's URL as process ``name`` sees it: through its own route."""
        if self.proxies is None:
            return self.settings.redis_url
        route = self.proxies.route(name, self.redis.ports, rewrite=self.redis_cluster)
        return self.redis.url_via(route.ports)

    def routes(self) -> list[Route]:
        return list(self.proxies.routes.values()) if self.proxies is not None else []

    def route(self, name: str) -> Route:
        """Process ``name``'s route to the data plane's Redis."""
        assert self.proxies is not None, "the cluster is not started"
        return self.proxies.routes[name]

    # -- starting ------------------------------------------------------------------

    def start(self) -> None:
        if self.hosts is None:
            self.proxies = Proxies()
        else:
            self.hosts.open()
        self.redis.start(wait_port)
        self._add("control", ["-m", "coordinator.launcher.cli", "control"])
        for i in range(self.coordinators):
            port = free_port()
            name = f"coordinator-{i}"
            self.ports[name] = port
            self._add(name, ["-m", "coordinator.launcher.cli", "coordinator", "--port", str(port),
                             "--host", self.address(name)])  # fmt: skip
        for stage in self.pipeline.stage_names:
            for _ in range(self.workers_per_stage):
                self.add_worker(stage)
        for name, port in self.ports.items():
            wait_port(self.address(name), port, 60)

    def _add(self, name: str, args: list[str]) -> Proc:
        full = [sys.executable, *args, "--pipeline", str(self.pipeline_path)]
        proc = self._proc(name, full)
        proc.start()
        self.procs[name] = proc
        return proc

    def add_worker(self, stage: str) -> str:
        """Start one more worker of ``stage`` (a fresh id, as a restarted pod gets)."""
        self._spawned += 1
        name = f"{stage}-w{self._spawned}"
        self._add(name, ["-m", "workers", "--stage", stage, "--worker-id", name])
        return name

    # -- what the nemesis and the clients see ---------------------------------------

    def endpoints_by_name(self) -> dict[str, str]:
        """Each coordinator's ws:// base."""
        return {name: f"ws://{self.address(name)}:{port}" for name, port in self.ports.items()}

    def endpoints(self) -> list[str]:
        """ws:// bases of the coordinators that are running."""
        bases = self.endpoints_by_name()
        return [bases[name] for name in self.ports if self.procs[name].alive]

    def workers(self, *, running: bool = True) -> list[str]:
        return [
            name
            for name, proc in self.procs.items()
            if "-w" in name and proc.alive and (not running or not proc.stopped)
        ]

    def coordinator_names(self) -> list[str]:
        return list(self.ports)

    def serving_coordinators(self) -> list[str]:
        """Coordinators running, not stopped and not cut off on an isolated host."""
        return [n for n in self.ports if self.procs[n].alive and not self.procs[n].stopped
                and not self.isolated(n)]  # fmt: skip

    def isolated(self, name: str) -> bool:
        """Whether process ``name`` runs on a host that is partitioned off now."""
        return self.hosts is not None and self.placed.get(name) in self.hosts.isolated

    def routed(self) -> list[str]:
        """Processes running with a route of their own (not stopped)."""
        names = self.proxies.routes if self.proxies is not None else {}
        return [n for n in names if n in self.procs and self.procs[n].alive
                and not self.procs[n].stopped]  # fmt: skip

    def restart(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()
        proc.start()

    def stop(self) -> None:
        """Everything down: workers and coordinators first, Redis last."""
        for proc in self.procs.values():
            proc.resume()
        for proc in self.procs.values():
            proc.signal(signal.SIGTERM)
        for proc in self.procs.values():
            proc.terminate(15)
        if self.proxies is not None:
            self.proxies.stop()
        self.redis.stop()
        if self.hosts is not None:
            self.hosts.close()
