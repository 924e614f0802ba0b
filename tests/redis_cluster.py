"""A real local Redis Cluster for tests: 3 primaries, each with a replica (or none).

Six redis-server processes (own ports, own temp dirs, persisting as every
Redis duplexq starts does) joined with ``redis-cli --cluster create``. A node
can be killed with SIGKILL; its replica is promoted by the cluster itself.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from chaos.cluster import cluster_port
from tests.redis_server import RedisServer

NODE_TIMEOUT_MS = 1000
"""How long the cluster waits before it promotes a dead primary's replica."""


class RedisCluster:
    """Six nodes (three with ``replicas=0``); ``url`` is the duplexq URL
    (``redis+cluster://``) naming the three created as primaries, as a deployment names
    several seed nodes. ``extra``: more redis-server options for every node (an ACL
    user's)."""

    def __init__(
        self, workdir: Path, *, replicas: int = 1, extra: Sequence[str] = (), tls: bool = False
    ) -> None:
        options = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--repl-diskless-sync-delay", "0",
            *extra,
        ]  # fmt: skip
        self.replicas = replicas
        """Replicas per primary (0: a cluster whose primaries have none)."""
        self.cert: Path | None = None
        """With ``tls``: the self-signed certificate every node serves (its own CA)."""
        if tls:
            self.cert = workdir / "cert.pem"
            options += tls_options(workdir)
        count = 3 * (1 + replicas)
        self.nodes = [RedisServer(workdir / f"node{i}", extra=options) for i in range(count)]
        self.tls_ports: dict[int, int] = {}
        """With ``tls``: each node's TLS port, by its plain port. The nodes talk to one
        another (cluster bus, replication) and to duplexq over TLS only; the plain port
        is the tests' own way in (``wait_ok``, ``primary_of``)."""
        for node in self.nodes:
            node.port = cluster_port()
            if tls:
                # The cluster bus listens 10000 above the TLS port: cluster_port keeps it free.
                self.tls_ports[node.port] = cluster_port()
                node.extra += ["--tls-port", str(self.tls_ports[node.port])]

    @property
    def url(self) -> str:
        """duplexq's URL for the cluster: ``rediss+cluster://`` with the CA to trust when
        the cluster speaks TLS."""
        if self.cert is None:
            seeds = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[:3])
            return f"redis+cluster://{seeds}"
        seeds = ",".join(f"127.0.0.1:{self.tls_ports[node.port]}" for node in self.nodes[:3])
        return f"rediss+cluster://{seeds}?ssl_ca_certs={self.cert}&ssl_check_hostname=false"

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.stop()  # the nodes already started do not outlive a failed start
            raise
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed; run scripts/setup")
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas",
             str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node says the cluster is ok and covers every slot, and
        every live node tells the same roles of the live nodes (gossip has spread who
        replicates whom: a node that learnt it late would list a replica as a primary
        without slots, and a test reading the cluster through it would see another
        cluster than the one it made)."""
        deadline = time.monotonic() + timeout
        while True:
            live = [node for node in self.nodes if node.alive]
            states = [self._state(node) for node in live]
            views = {self._roles(node, {n.port for n in live}) for node in live}
            if states and all(s == "ok" for s in states) and len(views) == 1:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok: {states}, {len(views)} views of its roles")
            time.sleep(0.1)

    @staticmethod
    def _roles(node: RedisServer, live: set[int]) -> frozenset[tuple[int, str, int]]:
        """What ``node``'s ``CLUSTER NODES`` says of each live node: its port, its role
        and its primary's port (0 for a primary); empty when the node does not answer."""
        try:
            with redis.Redis(port=node.port, socket_timeout=1) as client:
                text = client.execute_command("CLUSTER", "NODES").decode()
        except redis.RedisError:
            return frozenset()
        lines = [line.split() for line in text.splitlines() if line.strip()]
        port_of = {f[0]: int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in lines}
        roles = set()
        for f in lines:
            role = "primary" if "master" in f[2] else "replica"
            roles.add((port_of[f[0]], role, port_of.get(f[3], 0)))
        return frozenset(r for r in roles if r[0] in live)

    @staticmethod
    def _state(node: RedisServer) -> str:
        """``ok`` once the node sees the whole cluster serving and, for a replica, its
        link to its primary is up (a replica still syncing acknowledges nothing)."""
        try:
            with redis.Redis(port=node.port, socket_timeout=1) as client:
                info = client.execute_command("CLUSTER", "INFO").decode()
                replication = client.info("replication")
        except redis.RedisError:
            return "down"
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        if fields.get("cluster_slots_ok") != "16384":
            return "partial"
        if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
            return "syncing"
        return fields.get("cluster_state", "?")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        """The replica of ``primary``, as the primary's ``CLUSTER NODES`` tells."""
        for port, role, of in self._roles(primary, {node.port for node in self.nodes}):
            if role == "replica" and of == primary.port:
                return next(node for node in self.nodes if node.port == port)
        raise LookupError(primary.port)

    def primary_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now."""
        with redis.Redis(port=self.live().port, socket_timeout=2) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(node for node in self.nodes if node.port == port)
        raise LookupError(key)

    def live(self) -> RedisServer:
        return next(node for node in self.nodes if node.alive)

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()


class SlotMove:
    """A slot moved from ``source`` to ``target`` step by step, as a reshard does:
    ``begin`` marks it migrating (and importing), ``migrate`` moves some of its keys,
    ``finish`` moves the rest and gives the slot to ``target`` on every node. Between
    ``migrate`` and ``finish`` a call naming keys of the slot finds them split."""

    def __init__(
        self, source: RedisServer, target: RedisServer, nodes: list[RedisServer], slot: int
    ) -> None:
        self.source, self.target, self.nodes, self.slot = source, target, nodes, slot

    @staticmethod
    def node_id(node: RedisServer) -> str:
        with redis.Redis(port=node.port) as client:
            return str(client.execute_command("CLUSTER", "MYID").decode())

    def begin(self) -> SlotMove:
        source_id, target_id = self.node_id(self.source), self.node_id(self.target)
        with redis.Redis(port=self.target.port) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", source_id)
        with redis.Redis(port=self.source.port) as src:
            src.execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", target_id)
        return self

    def migrate(self, *keys: str) -> None:
        with redis.Redis(port=self.source.port) as src:
            src.execute_command(
                "MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *keys
            )

    def finish(self) -> None:
        with redis.Redis(port=self.source.port) as src:
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 100):
                self.migrate(*(key.decode() for key in keys))
        target_id = self.node_id(self.target)
        for node in [self.target, self.source, *self.nodes]:
            with redis.Redis(port=node.port) as client:
                client.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", target_id)


def move_slot(
    source: RedisServer, target: RedisServer, nodes: list[RedisServer], slot: int
) -> None:
    """Move ``slot`` and its keys from ``source`` to ``target``, as a reshard does."""
    SlotMove(source, target, nodes, slot).begin().finish()


def slot_of(cluster: RedisCluster, key: str) -> int:
    with redis.Redis(port=cluster.live().port) as client:
        return int(client.execute_command("CLUSTER", "KEYSLOT", key))


def cluster_state(node: RedisServer) -> str:
    with redis.Redis(port=node.port) as client:
        return str(client.execute_command("CLUSTER", "INFO").decode()).split()[0]


def another_slot_of(node: RedisServer, *taken: int) -> int:
    """A slot ``node`` serves, not one of ``taken``."""
    with redis.Redis(port=node.port) as client:
        for first, last, owner, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if int(owner[1]) == node.port:
                return next(s for s in range(first, last + 1) if s not in taken)
    raise LookupError("the node serves no slot")


def tls_options(workdir: Path) -> list[str]:
    """redis-server options for a node that serves TLS with a self-signed certificate
    made in ``workdir`` (made once), and speaks TLS to the other nodes."""
    workdir.mkdir(parents=True, exist_ok=True)
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    if not cert.exists():
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
             "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    return [
        "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
        "--tls-cluster", "yes", "--tls-replication", "yes",
    ]  # fmt: skip
