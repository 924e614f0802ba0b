"""The Redis a nemesis run uses: one server, or a Redis Cluster of six nodes.

Both persist as every Redis duplexq starts does (``REDIS_PERSISTENCE``). The
cluster has 3 primaries with a replica each. What the nemesis does to them:

- ``bounce``: SIGKILL the Redis (on a cluster: a replica) and start it again on
  its AOF after a pause (a replica then syncs again from its primary);
- ``restart_primary``: SIGKILL a primary and start it again before the cluster's
  node timeout, so that no failover happens (whether one did is reported);
- ``kill_primary``, then ``start``: SIGKILL a primary, wait until its replica is
  promoted, start the old one again: it rejoins as the new primary's replica;
- ``fill`` and ``unfill``: Redis at its memory limit (``maxmemory`` set just
  above what it uses, ``noeviction`` as shipped) and back.

Any primary may be hit, the first node the URL names too: the URL names three
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
LOCAL = "127.0.0.1"
CLI_TIMEOUT_S = 2.0
"""Longest a ``redis-cli`` call of the nemesis waits (a partitioned node never answers)."""
OOM_MARGIN_BYTES = 64 * 1024
"""How far above its used memory a filled Redis's ``maxmemory`` is set."""


class Process(Protocol):
    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...
    def kill(self) -> None: ...
    def terminate(self, within_s: float = 15) -> None: ...


ProcFactory = Callable[[str, list[str]], Process]
"""Makes a named child process from its command line (``chaos.cluster.Cluster._proc``)."""
Placement = Callable[[str], str]
"""The address a named node listens on: its host's (``chaos.hosts``), or loopback."""


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (scripts/setup installs it)")
    return found


def _server_args(port: int, data: Path, extra: list[str], host: str = LOCAL) -> list[str]:
    data.mkdir(parents=True, exist_ok=True)
    # On a simulated host (``chaos.hosts``) the node listens on the host's address, is
    # reached from other hosts (no protected mode: no password here) and tells the
    # other nodes that address.
    remote = [] if host == LOCAL else ["--protected-mode", "no"]
    announce = ["--cluster-announce-ip", host] if remote and "--cluster-enabled" in extra else []
    return [
        _binary("redis-server"), "--port", str(port), "--bind", host, "--dir", str(data),
        *REDIS_PERSISTENCE, "--save", "", "--maxmemory-policy", "noeviction", *extra, *remote,
        *announce,
    ]  # fmt: skip


class RedisNodes:
    """Start, bounce and stop the run's Redis processes."""

    def __init__(self, workdir: Path, make: ProcFactory, ports: Callable[[], int], *,
                 cluster: bool, place: Placement = lambda name: LOCAL) -> None:  # fmt: skip
        self.cluster = cluster
        self.ports = [ports() for _ in range(6 if cluster else 1)]
        extra = (
            ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--repl-diskless-sync-delay", "0"]
            if cluster else []
        )  # fmt: skip
        names = [f"redis-{i}" if cluster else "redis" for i in range(len(self.ports))]
        self.hosts = [place(name) for name in names]
        self.nodes = [
            make(name, _server_args(port, workdir / name, extra, host))
            for name, port, host in zip(names, self.ports, self.hosts, strict=True)
        ]
        self._filled: dict[int, int] = {}
        """Filled nodes -> their count of memory refusals when filled."""
        self.queue_port = ports()
        self.queue_host = place("redis-queue")
        queue_args = _server_args(self.queue_port, workdir / "redis-queue", [], self.queue_host)
        self.queue = make("redis-queue", queue_args) if cluster else None

    @property
    def url(self) -> str:
        return self.url_via({port: port for port in self.ports})

    def url_via(self, ports: dict[int, int]) -> str:
        """The data plane's URL with each node's port replaced by ``ports[port]`` (a
        process's own route to it)."""
        if not self.cluster:
            return f"redis://{self.hosts[0]}:{ports[self.ports[0]]}/0"
        # Several seeds: a process (re)started while a killed node is down still
        # reaches the cluster.
        seeds = ",".join(f"{self._host(port)}:{ports[port]}" for port in self.ports[:3])
        return f"redis+cluster://{seeds}/0"

    @property
    def queue_url(self) -> str:
        queue = f"redis://{self.queue_host}:{self.queue_port}/0"
        return queue if self.queue is not None else ""

    def _host(self, port: int) -> str:
        """The address of the node listening on ``port`` (ports are unique in a run)."""
        return self.queue_host if port == self.queue_port else self.hosts[self.ports.index(port)]

    def start(self, wait_port: Callable[[str, int, float], None]) -> None:
        for node in [*self.nodes, *([self.queue] if self.queue else [])]:
            node.start()
        for port in self.ports:
            wait_port(self._host(port), port, 10)
        if self.queue is not None:
            wait_port(self.queue_host, self.queue_port, 10)
        if self.cluster:
            subprocess.run(
                [_binary("redis-cli"), "--cluster", "create",
                 *(f"{self._host(port)}:{port}" for port in self.ports),
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

    def _cli(self, port: int, *args: str) -> str:
        """A command's reply, or "" when the node did not answer in time."""
        command = [_binary("redis-cli"), "-h", self._host(port), "-p", str(port), *args]
        try:
            return subprocess.run(
                command, check=False, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
            ).stdout
        except subprocess.TimeoutExpired:
            return ""

    def _ok(self, port: int) -> bool:
        info = self._cli(port, "cluster", "info")
        repl = self._cli(port, "info", "replication")
        if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
            return False
        return "role:slave" not in repl or "master_link_status:up" in repl

    def name(self, index: int) -> str:
        return f"redis-{index}" if self.cluster else "redis"

    def settled(self, within_s: float = 15) -> None:
        """On a cluster, wait (at most ``within_s``) until every node is up, every slot
        served and every replica in sync: one fault on the cluster at a time."""
        if self.cluster:
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline and not all(self._ok(p) for p in self.ports):
                time.sleep(0.1)

    def bounce(self, rng: random.Random, down_s: float) -> str:
        """SIGKILL one Redis (on a cluster: a replica) and start it again after
        ``down_s``; returns which."""
        index = 0
        if self.cluster:
            self.settled()
            replicas = self._with_role("slave")
            index = rng.choice(replicas or list(range(len(self.nodes))))
        node = self.nodes[index]
        node.kill()
        time.sleep(down_s)
        node.start()
        return self.name(index)

    def restart_primary(self, rng: random.Random, down_s: float) -> str:
        """SIGKILL a primary and start it again after ``down_s`` (less than the node
        timeout); returns which, and whether its replica was promoted all the same
        (known once the node serves again, or after 15 s)."""
        self.settled()
        index = rng.choice(self._with_role("master") or list(range(len(self.nodes))))
        node = self.nodes[index]
        node.kill()
        time.sleep(down_s)
        node.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not self._ok(self.ports[index]):
            time.sleep(0.05)
        role = self._role(index)
        return self.name(index) + ("" if role == "master" else f" (failed over: {role})")

    def kill_primary(self, rng: random.Random, within_s: float = 20) -> tuple[int, str]:
        """SIGKILL a primary and wait (at most ``within_s``) until its replica is
        promoted; returns the killed node (``start`` brings it back) and what happened."""
        self.settled()
        index = rng.choice(self._with_role("master") or list(range(len(self.nodes))))
        replica = self._replica_of(index)
        self.nodes[index].kill()
        if replica is None:
            return index, f"{self.name(index)} (had no replica)"
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self._role(replica) == "master":
                return index, f"{self.name(index)} -> {self.name(replica)}"
            time.sleep(0.05)
        return index, f"{self.name(index)} (no promotion in {within_s:g} s)"

    def primaries_at(self, host: str) -> dict[int, int | None]:
        """The primaries listening on ``host`` (any host: "") -> the node replicating
        each (if any)."""
        at = [i for i in self._with_role("master") if host in ("", self.hosts[i])]
        return {index: self._replica_of(index) for index in at}

    def promoted(self, replicas: list[int], within_s: float = 20) -> bool:
        """Wait (at most ``within_s``) until every one of ``replicas`` is a primary."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if all(self._role(index) == "master" for index in replicas):
                return True
            time.sleep(0.05)
        return False

    def fail_back(self, index: int, within_s: float = 10) -> str:
        """Make node ``index`` (a replica again) its primary's primary once more by the
        graceful handover (``CLUSTER FAILOVER``: the primary stops taking writes until
        the replica has them all, then they swap, nothing lost); returns its role."""
        self.settled(20)
        if self._role(index) == "slave":
            self._cli(self.ports[index], "cluster", "failover")
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline and self._role(index) != "master":
                time.sleep(0.05)
            self.settled(20)
        return self._role(index)

    def rebalance(self) -> list[str]:
        """Fail back every node created as a primary (``redis-0`` to ``redis-2``) that is
        a replica now (after a promotion): on hosts, one primary per host again; returns
        the nodes failed back."""
        self.settled()
        back = [i for i in range(len(self.nodes) // 2) if self._role(i) == "slave"]
        return [f"{self.name(i)} {self.fail_back(i)}" for i in back]

    def roles(self, indices: list[int]) -> str:
        return ", ".join(f"{self.name(i)} {self._role(i)}" for i in indices)

    def rejoin(self, index: int) -> str:
        """Start a killed node again (on its AOF and its cluster configuration); returns
        what it is once the cluster settled."""
        if not self.nodes[index].alive:
            self.nodes[index].start()
        self.settled(20)
        return f"{self.name(index)} back as {self._role(index)}"

    def fill(self, rng: random.Random) -> tuple[int, str]:
        """Redis (on a cluster: a primary) at its memory limit: ``maxmemory`` just above
        the memory it uses, so that writes are refused; ``unfill`` restores it."""
        index = rng.choice(self._with_role("master")) if self.cluster else 0
        port = self.ports[index]
        used = int(self._info(port, "memory").get("used_memory", "0"))
        self._cli(port, "config", "set", "maxmemory", str(used + OOM_MARGIN_BYTES))
        self._filled.setdefault(index, self._oom_errors(port))
        return index, self.name(index)

    @property
    def filled(self) -> bool:
        """Whether a node is at its memory limit now (``fill`` without ``unfill``)."""
        return bool(self._filled)

    def unfill(self, index: int) -> str:
        """``maxmemory`` back to its setting (none); returns how many commands Redis
        refused for memory while it was filled."""
        port = self.ports[index]
        self._cli(port, "config", "set", "maxmemory", "0")
        before = self._filled.pop(index, 0)
        return f"{self.name(index)} refused {max(0, self._oom_errors(port) - before)} commands"

    def _oom_errors(self, port: int) -> int:
        stat = self._info(port, "errorstats").get("errorstat_OOM", "count=0")
        return int(stat.split(",", 1)[0].removeprefix("count="))

    def _info(self, port: int, section: str) -> dict[str, str]:
        lines = self._cli(port, "info", section).splitlines()
        return dict(line.split(":", 1) for line in lines if ":" in line)

    def _with_role(self, role: str) -> list[int]:
        return [i for i in range(len(self.nodes)) if self._role(i) == role]

    def _replica_of(self, index: int) -> int | None:
        """The node replicating primary ``index``, if one is connected."""
        for key, value in self._info(self.ports[index], "replication").items():
            if key.startswith("slave") and "port=" in value:
                fields = dict(part.split("=", 1) for part in value.split(",") if "=" in part)
                port = int(fields["port"])
                if port in self.ports:
                    return self.ports.index(port)
        return None

    def _role(self, index: int) -> str:
        return self._info(self.ports[index], "replication").get("role", "down").strip()

    def heal(self) -> None:
        for index in list(self._filled):
            self.unfill(index)
        for node in self.nodes:
            if not node.alive:
                node.start()

    def stop(self) -> None:
        for node in [*self.nodes, *([self.queue] if self.queue else [])]:
            node.terminate(15)
