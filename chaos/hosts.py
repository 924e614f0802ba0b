"""Simulated hosts on this machine: network namespaces on one bridge.

The nemesis's ``--hosts`` mode runs Redis nodes, workers and coordinators on
hosts of their own, each a network namespace with its own address on a
private /24 (``10.231.X.0/24``, X the first one no interface of this machine
uses). Every host has a veth pair: one end (``eth0``) in the namespace, the
other on a bridge in the root namespace. The bridge holds the subnet's ``.1``,
so the nemesis and its clients, which stay in the root namespace, reach every
host by its address.

``isolate(host)`` sets the host's bridge-side veth down: nothing reaches the
host or leaves it, and no socket is closed (no RST, no FIN), as when a
machine's link fails; ``heal(host)`` sets it up again and what TCP held is
retransmitted. The host's own processes still reach each other on its
loopback and its address.

Names carry this process's pid (``dqh-<pid>-<i>`` for namespaces,
``dqh<pid>b`` / ``dqh<pid>v<i>`` for links), so that ``sweep`` can remove what a
run that crashed left behind (its pid no longer alive) without touching a
concurrent run's. ``close`` removes everything this run made, also the
processes still inside a namespace; it is idempotent and runs on every exit
path of a run (``chaos.__main__``), and at the interpreter's exit as a last
resort.

Needs root (``ip netns add``); ``require_root`` says so clearly.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field

PREFIX = "dqh"
"""Every namespace and link of the suite starts with this."""
SUBNET = "10.231"
"""The /16 whose /24s the runs take: private, unlikely to clash."""


def _ip(*args: str, check: bool = True) -> str:
    run = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=10)
    if check and run.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")
    return run.stdout


def require_root() -> None:
    """Network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)."""
    if os.geteuid() != 0:
        raise PermissionError(
            "the nemesis's --hosts mode makes network namespaces (ip netns add): run it as root"
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(namespace: str) -> None:
    """SIGKILL whatever still runs in ``namespace`` (deleting it would not stop them)."""
    for pid in _ip("netns", "pids", namespace, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep() -> list[str]:
    """Remove the namespaces and links of earlier runs whose process is gone; returns
    their names."""
    removed = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        found = re.fullmatch(rf"{PREFIX}-(\d+)-\d+", name)
        if found and not _alive(int(found[1])):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        found = re.fullmatch(rf"{PREFIX}(\d+)[bv]\d*", name)
        if found and not _alive(int(found[1])):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def free_subnet() -> str:
    """``10.231.X``: the first X no address or route of the root namespace uses."""
    used = _ip("-4", "-o", "addr", "show") + _ip("-4", "route", "show")
    for third in range(1, 255):
        if f"{SUBNET}.{third}." not in used:
            return f"{SUBNET}.{third}"
    raise RuntimeError(f"every {SUBNET}.X.0/24 is in use on this machine")


@dataclass
class Hosts:
    """``count`` simulated hosts on one bridge; ``open`` makes them, ``close`` removes
    them."""

    count: int
    pid: int = field(default_factory=os.getpid)
    subnet: str = ""
    isolated: set[int] = field(default_factory=set)
    _made: list[tuple[str, str]] = field(default_factory=list)
    """What ``open`` made, in order: ("netns" | "link", name)."""

    def __post_init__(self) -> None:
        # Chosen now, made by ``open``: the processes' command lines name addresses.
        self.subnet = self.subnet or free_subnet()

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.pid}b"

    @property
    def gateway(self) -> str:
        """The bridge's address: the root namespace (the nemesis and its clients)."""
        return f"{self.subnet}.1"

    def namespace(self, index: int) -> str:
        return f"{PREFIX}-{self.pid}-{index}"

    def veth(self, index: int) -> str:
        """The bridge side of host ``index``'s link."""
        return f"{PREFIX}{self.pid}v{index}"

    def address(self, index: int) -> str:
        return f"{self.subnet}.{11 + index}"

    def open(self) -> None:
        require_root()
        sweep()
        # The last resort when the run's own ``finally`` did not get to it (an interrupt
        # while starting, say); a run killed outright is left to the next run's sweep.
        atexit.register(self.close)
        try:
            self._step("link", self.bridge, "link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index in range(self.count):
                self._host(index)
        except BaseException:
            self.close()
            raise

    def _step(self, kind: str, name: str, *args: str) -> None:
        _ip(*args)
        self._made.append((kind, name))

    def _host(self, index: int) -> None:
        ns, outer, inner = self.namespace(index), self.veth(index), f"{PREFIX}{self.pid}p{index}"
        self._step("netns", ns, "netns", "add", ns)
        self._step("link", outer, "link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        for args in (("link", "set", "lo", "up"),
                     ("link", "set", inner, "name", "eth0"),
                     ("addr", "add", f"{self.address(index)}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up")):  # fmt: skip
            _ip("-n", ns, *args)

    def command(self, index: int, args: list[str]) -> list[str]:
        """``args`` run on host ``index`` (``ip netns exec`` execs it: the pid is the
        process's own, signals reach it)."""
        return ["ip", "netns", "exec", self.namespace(index), *args]

    def isolate(self, index: int) -> None:
        _ip("link", "set", self.veth(index), "down")
        self.isolated.add(index)

    def heal(self, index: int) -> None:
        _ip("link", "set", self.veth(index), "up")
        self.isolated.discard(index)

    def close(self) -> None:
        """Remove every namespace and link this run made (their processes killed)."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                _kill_inside(name)
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()
        self.isolated.clear()


DATA_HOSTS = 3
"""Hosts 0-2 hold the Redis Cluster's nodes (two each); the last host holds the control
plane and its job queue, and is never partitioned."""


def place(name: str, spawned: int = 0, *, hosts: int = DATA_HOSTS + 1) -> int:
    """The host a process of the run lives on.

    ``redis-<i>``: host ``i % 3``, so the cluster's create step (which puts a replica
    on another address than its primary) leaves each host a primary and another's
    replica; ``coordinator-<i>``: host ``i % 3``; the control plane and
    ``redis-queue``: the last host; the ``spawned``-th worker: round robin over every
    host. Isolating a host holding a primary thus cuts off at most one coordinator
    and a minority of the workers with it."""
    if name.startswith(("redis-", "coordinator-")) and name.rsplit("-", 1)[1].isdigit():
        return int(name.rsplit("-", 1)[1]) % DATA_HOSTS
    if name in ("control", "redis-queue", "redis"):
        return hosts - 1
    return (spawned - 1) % hosts
