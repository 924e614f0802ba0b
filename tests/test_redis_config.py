"""The start-up check of the data plane's Redis (``dataplane.redis_config``).

The core on hand-built configurations; then real redis-server processes, each on its
own port and in its own temp dir, and real duplexq processes started on them: a Redis
that cannot keep an acknowledged input is refused in one line (exit code 2) unless
``redis_durability`` is ``relaxed``, and the shipped configuration starts clean.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from dataplane.cluster_nodes import live_replicas
from dataplane.redis_config import (
    Finding,
    Member,
    NodeReport,
    Observed,
    Severity,
    config_findings,
    decide,
    findings,
    observe,
    online_replicas,
    parse_cluster_nodes,
)
from schemas.config import Settings, echo_pipeline
from tests.processes import ROOT, WorkerProcess, write_pipeline
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer, free_port

SHIPPED = {
    # What REDIS_PERSISTENCE and the shipped command lines give, with Redis 7's defaults.
    "appendonly": "yes",
    "appendfsync": "always",
    "no-appendfsync-on-rewrite": "no",
    "maxmemory-policy": "noeviction",
    "repl-diskless-sync": "yes",
    "repl-diskless-sync-delay": "0",
}

EVERYSEC = ["--appendfsync", "everysec"]
"""A Redis that replies before its AOF is on disk (the docs say it is not offered)."""


# -- the core ---------------------------------------------------------------------------


def shipped(**changes: str) -> dict[str, str]:
    return {**SHIPPED, **{k.replace("_", "-"): v for k, v in changes.items()}}


@pytest.mark.parametrize(
    ("config", "cluster", "expected"),
    [
        (shipped(), False, []),
        (shipped(), True, []),
        (shipped(appendfsync="everysec"), False, [("error", "appendfsync", "everysec")]),
        (shipped(appendfsync="no"), False, [("error", "appendfsync", "no")]),
        # Without AOF, fsync is moot: one finding, not two.
        (shipped(appendonly="no", appendfsync="everysec"), False, [("error", "appendonly", "no")]),
        (
            shipped(no_appendfsync_on_rewrite="yes"),
            False,
            [("error", "no-appendfsync-on-rewrite", "yes")],
        ),
        (shipped(maxmemory_policy="allkeys-lru"), False,
         [("error", "maxmemory-policy", "allkeys-lru")]),
        # Leases and closed sessions' keys have a TTL: volatile policies evict them.
        (shipped(maxmemory_policy="volatile-ttl"), False,
         [("error", "maxmemory-policy", "volatile-ttl")]),
        # The diskless sync delay slows a rejoining replica: a cluster's concern, a warning.
        (shipped(repl_diskless_sync_delay="5"), False, []),
        (shipped(repl_diskless_sync_delay="5"), True,
         [("warning", "repl-diskless-sync-delay", "5")]),
        (shipped(repl_diskless_sync="no", repl_diskless_sync_delay="5"), True, []),
        # A setting Redis does not report is not judged.
        ({"appendonly": "yes"}, False, []),
    ],
)  # fmt: skip
def test_config_findings(config, cluster, expected):
    found = config_findings(config, cluster=cluster)
    assert [(f.severity.value, f.setting, f.value) for f in found] == expected
    for f in found:  # each line names the setting and its value
        assert f.line.startswith(f"{f.setting} is {f.value}, not "), f.line
        assert "\n" not in f.line


def test_a_refused_config_or_a_silent_node_is_a_warning():
    refused = Observed(False, (NodeReport("", config_error="unknown command 'CONFIG'"),))
    [finding] = findings(refused)
    assert (finding.severity, finding.setting) == (Severity.WARNING, "CONFIG")
    assert "unknown command 'CONFIG'" in finding.line and "operator" in finding.line
    silent = Observed(True, (NodeReport("10.0.0.1:7000", unreachable="timed out"),))
    [finding] = findings(silent)
    assert finding.severity is Severity.WARNING
    assert finding.line.endswith("(on 10.0.0.1:7000)")


def test_decide_refuses_errors_unless_relaxed():
    error = Finding(Severity.ERROR, "appendfsync", "everysec", "appendfsync is everysec, ...")
    other = Finding(Severity.ERROR, "maxmemory-policy", "allkeys-lru", "maxmemory-policy is ...")
    warning = Finding(Severity.WARNING, "CONFIG", "refused", "CONFIG GET is refused ...")
    where = "redis://h:1/0"
    verdict = decide([error, other, warning], "required", where)
    assert verdict.refusal == (
        "Redis at redis://h:1/0 cannot keep acknowledged inputs: appendfsync is everysec, ...; "
        "maxmemory-policy is ... (DUPLEXQ_REDIS_DURABILITY=relaxed runs on it anyway; "
        "docs/deploy.md)"
    )
    assert verdict.warnings == ("Redis at redis://h:1/0: CONFIG GET is refused ...",)
    relaxed = decide([error, warning], "relaxed", where)
    assert relaxed.refusal is None
    assert relaxed.warnings == (
        "Redis at redis://h:1/0: appendfsync is everysec, ... (accepted: redis_durability is "
        "relaxed)",
        "Redis at redis://h:1/0: CONFIG GET is refused ...",
    )
    assert decide([warning], "required", where).refusal is None
    assert decide([], "required", where) == decide([], "relaxed", where)


def test_a_finding_on_several_nodes_is_one_line_naming_them():
    reports = tuple(
        NodeReport(f"h:{port}", shipped(appendfsync="everysec"), replication=_online(1))
        for port in (1, 2)
    )
    found = findings(Observed(True, reports, ()))
    assert [f.line.rsplit(" (on ", 1)[1] for f in found] == ["h:1, h:2)"]


NODES = """\
a1 10.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
a2 10.0.0.2:7000@17000,redis-node-1 master - 0 0 2 connected 5461-10922
a3 10.0.0.3:7000@17000 master - 0 0 3 connected 10923-16383
b1 10.0.0.4:7000@17000 slave a1 0 0 1 connected
b2 10.0.0.5:7000@17000 slave a2 0 0 2 connected
b3 10.0.0.6:7000@17000 slave a3 0 0 3 connected
"""


def _online(count: int, syncing: int = 0):
    info = {"role": "master", "connected_slaves": count + syncing}
    for i in range(count + syncing):
        state = "online" if i < count else "wait_bgsave"
        info[f"slave{i}"] = {"ip": "x", "port": 1, "state": state}
    return info


def test_parse_cluster_nodes():
    unknown_ip = "c1 :7001@17001 myself,master - 0 0 0 connected\n"  # a lone node's own line
    members = parse_cluster_nodes(NODES + unknown_ip, "seed")
    assert [m.name for m in members] == [
        "10.0.0.1:7000", "redis-node-1:7000", "10.0.0.3:7000",  # an announced hostname wins
        "10.0.0.4:7000", "10.0.0.5:7000", "10.0.0.6:7000", "seed:7001",
    ]  # fmt: skip
    assert [m.is_primary for m in members] == [True] * 3 + [False] * 3 + [True]
    assert [m.serves_slots for m in members] == [True] * 3 + [False] * 4
    assert members[3].primary_id == "a1"
    assert Member("x", "::1", 7000, frozenset(), "-", False).name == "[::1]:7000"


def test_live_replicas_are_those_of_the_node_asked_that_it_sees_up():
    """What a script batch's replica count comes from when INFO is refused
    (``dataplane.replica_count``)."""
    assert live_replicas(NODES) == 1  # a1 (myself) has b1
    assert (
        live_replicas(
            NODES.replace("b1 10.0.0.4:7000@17000 slave", "b1 10.0.0.4:7000@17000 slave,fail?")
        )
        == 0
    )
    assert live_replicas(NODES.replace("slave a2", "slave a1")) == 2
    assert live_replicas(NODES.replace("myself,", "")) == 0  # not a node's own view
    # Its link down (its process died, or a busy node missed a PONG), not yet flagged
    # failed: it counts unless asked for linked ones (after an unanswered WAIT).
    unlinked = NODES.replace("slave a1 0 0 1 connected", "slave a1 0 0 1 disconnected")
    assert live_replicas(unlinked) == 1
    assert live_replicas(unlinked, linked=True) == 0
    assert live_replicas(NODES, linked=True) == 1


def test_online_replicas():
    assert online_replicas(_online(2, syncing=1)) == 2
    assert online_replicas({"role": "master", "connected_slaves": 0}) == 0
    assert online_replicas({"slave0": "ip=x,port=1,state=online,offset=1,lag=0"}) == 1


def _cluster(text: str, replication: dict[str, dict]) -> Observed:
    members = parse_cluster_nodes(text)
    reports = tuple(
        NodeReport(m.name, SHIPPED, replication=replication.get(m.id, _online(1)))
        for m in members
        if not m.down
    )
    return Observed(True, reports, members)


@pytest.mark.parametrize(
    ("text", "replication", "expected"),
    [
        (NODES, {}, []),
        # A replica down or syncing: the cluster heals it; a warning.
        (NODES, {"a2": _online(0, syncing=1)}, [("warning", "replicas", "redis-node-1:7000")]),
        # A failover left a promoted replica alone while the old primary is down.
        (
            NODES.replace("a1 10.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460",
                          "a1 10.0.0.1:7000@17000 master,fail - 0 0 1 disconnected")
                 .replace("b1 10.0.0.4:7000@17000 slave a1 0 0 1 connected",
                          "b1 10.0.0.4:7000@17000 myself,master - 0 0 7 connected 0-5460"),
            {"b1": _online(0)},
            [("warning", "node", "10.0.0.1:7000"), ("warning", "replicas", "10.0.0.4:7000")],
        ),
        # ... and once the old primary is back, before it turns into the new one's replica.
        (
            NODES.replace("a1 10.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460",
                          "a1 10.0.0.1:7000@17000 master - 0 0 1 connected")
                 .replace("b1 10.0.0.4:7000@17000 slave a1 0 0 1 connected",
                          "b1 10.0.0.4:7000@17000 myself,master - 0 0 7 connected 0-5460"),
            {"b1": _online(0)},
            [("warning", "replicas", "10.0.0.1:7000")],
        ),
        # A primary with no replica at all, and no node that may become one.
        (
            "\n".join(line for line in NODES.splitlines() if not line.startswith("b3")),
            {"a3": _online(0)},
            [("error", "replicas", "10.0.0.3:7000")],
        ),
        # INFO refused (an ACL user): counted from CLUSTER NODES, as the batches do.
        (NODES, {"a1": None}, []),
        (
            NODES.replace("b1 10.0.0.4:7000@17000 slave a1 0 0 1 connected",
                          "b1 10.0.0.4:7000@17000 slave,fail a1 0 0 1 disconnected"),
            {"a1": None},
            [("warning", "node", "10.0.0.4:7000"), ("warning", "replicas", "10.0.0.4:7000 down")],
        ),
    ],
    ids=["healthy", "replica-syncing", "after-failover", "old-primary-back", "no-replica",
         "info-refused", "info-refused-replica-failed"],
)  # fmt: skip
def test_replica_findings(text, replication, expected):
    found = findings(_cluster(text, replication))
    assert [(f.severity.value, f.setting) for f in found] == [e[:2] for e in expected]
    for f, (_, _, node) in zip(found, expected, strict=True):
        assert node in f.line, f.line


def test_the_setting_travels_to_a_process_and_has_bounds():
    assert Settings().redis_durability == "required"
    env = Settings(redis_durability="relaxed").to_env()
    assert env["DUPLEXQ_REDIS_DURABILITY"] == "relaxed"
    with pytest.raises(ValueError, match="redis_durability"):
        Settings(redis_durability="off")


# -- real Redis, real processes ---------------------------------------------------------


@pytest.fixture
def everysec(tmp_path):
    server = RedisServer(tmp_path / "everysec", extra=EVERYSEC)
    server.start()
    yield server
    server.stop()


def _worker(tmp_path, settings: Settings, name: str = "w1") -> WorkerProcess:
    pipeline = write_pipeline(tmp_path, echo_pipeline("echo"))
    return WorkerProcess(settings, pipeline, "echo", name, tmp_path)


def _wait_for(worker: WorkerProcess, text: str, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while text not in worker.log():
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.05)


def _json_lines(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


async def test_the_shipped_redis_reports_nothing(redis_server):
    assert findings(await observe(redis_server.url)) == []


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--appendfsync", "everysec"], [("error", "appendfsync", "everysec")]),
        (["--appendonly", "no"], [("error", "appendonly", "no")]),
        (["--no-appendfsync-on-rewrite", "yes"], [("error", "no-appendfsync-on-rewrite", "yes")]),
        (["--maxmemory-policy", "allkeys-lru"], [("error", "maxmemory-policy", "allkeys-lru")]),
        # As a managed Redis does: CONFIG renamed away.
        (["--rename-command", "CONFIG", ""], [("warning", "CONFIG", "refused")]),
    ],
)  # fmt: skip
async def test_what_a_real_redis_reports(tmp_path, options, expected):
    server = RedisServer(tmp_path / "redis", extra=options)
    server.start()
    try:
        found = findings(await observe(server.url))
    finally:
        server.stop()
    assert [(f.severity.value, f.setting, f.value) for f in found] == expected


def test_a_worker_refuses_a_redis_with_appendfsync_everysec(tmp_path, everysec, key_prefix):
    worker = _worker(tmp_path, Settings(redis_url=everysec.url, key_prefix=key_prefix))
    worker.start()
    assert worker.proc is not None
    assert worker.proc.wait(30) == 2
    log = worker.log()
    assert "Traceback" not in log, log
    [line] = [line for line in log.splitlines() if not line.startswith("{")]
    assert line.startswith(
        f"error: Redis at {everysec.url} cannot keep acknowledged inputs: appendfsync is "
        "everysec, not always: Redis replies before its append-only file is on disk"
    ), line
    assert line.endswith("(DUPLEXQ_REDIS_DURABILITY=relaxed runs on it anyway; docs/deploy.md)")


def test_a_relaxed_worker_serves_a_redis_with_appendfsync_everysec_and_says_so(
    tmp_path, everysec, key_prefix
):
    settings = Settings(redis_url=everysec.url, key_prefix=key_prefix, redis_durability="relaxed")
    worker = _worker(tmp_path, settings)
    port = free_port()
    worker.args += ["--metrics-port", str(port)]
    worker.start()
    try:
        _wait_for(worker, "serving stage echo")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            metrics = reply.read().decode()
    finally:
        assert worker.terminate() == 0
    warnings = [e["msg"] for e in _json_lines(worker.log()) if e["level"] == "warning"]
    assert warnings == [
        f"Redis at {everysec.url}: appendfsync is everysec, not always: Redis replies before "
        "its append-only file is on disk, so a crash of Redis or its host loses inputs "
        "already acknowledged (accepted: redis_durability is relaxed)"
    ]
    gauge = 'duplexq_redis_config_findings{setting="appendfsync",severity="error"} 1.0'
    assert gauge in metrics, metrics


def test_a_worker_on_the_shipped_redis_starts_clean(tmp_path, redis_server, key_prefix):
    worker = _worker(tmp_path, Settings(redis_url=redis_server.url, key_prefix=key_prefix))
    worker.start()
    try:
        _wait_for(worker, "serving stage echo")
    finally:
        assert worker.terminate() == 0
    levels = {e["level"] for e in _json_lines(worker.log())}
    assert levels <= {"info"}, worker.log()


def test_a_worker_on_a_redis_that_refuses_config_warns_and_starts(tmp_path, key_prefix):
    # As a managed Redis does: CONFIG renamed away. The operator vouches for it.
    server = RedisServer(tmp_path / "managed", extra=["--rename-command", "CONFIG", ""])
    server.start()
    try:
        worker = _worker(tmp_path, Settings(redis_url=server.url, key_prefix=key_prefix))
        worker.start()
        try:
            _wait_for(worker, "serving stage echo")
        finally:
            assert worker.terminate() == 0
    finally:
        server.stop()
    [warning] = [e["msg"] for e in _json_lines(worker.log()) if e["level"] == "warning"]
    assert warning.startswith(f"Redis at {server.url}: CONFIG GET is refused (unknown command")


def test_a_worker_stopped_while_waiting_for_its_redis_exits_at_once(tmp_path, key_prefix):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there (yet)
    worker = _worker(tmp_path, Settings(redis_url=url, key_prefix=key_prefix))
    worker.start()
    _wait_for(worker, "cannot reach Redis")
    # 0: it ended its wait, not the grace timer that ends a stuck worker (exit 1).
    assert worker.terminate() == 0


@pytest.mark.parametrize(
    "command",
    [["coordinator"], ["control"], ["control", "--burst"], ["replay", "a", "b"],
     ["up", "--no-demo", "--workdir", "{tmp}"]],
    ids=["coordinator", "control", "control-burst", "replay", "up"],
)  # fmt: skip
def test_every_command_refuses_a_redis_with_appendfsync_everysec(tmp_path, everysec, command):
    args = [part.replace("{tmp}", str(tmp_path)) for part in command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEXQ_")}
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.launcher.cli", *args, "--pipeline",
         str(ROOT / "configs" / "echo.toml"), "--redis-url", everysec.url],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert lines == [
        f"duplexq {args[0]}: error: Redis at {everysec.url} cannot keep acknowledged inputs: "
        "appendfsync is everysec, not always: Redis replies before its append-only file is "
        "on disk, so a crash of Redis or its host loses inputs already acknowledged "
        "(DUPLEXQ_REDIS_DURABILITY=relaxed runs on it anyway; docs/deploy.md)"
    ], done.stderr


# -- a real Redis Cluster ---------------------------------------------------------------


async def test_the_suites_cluster_reports_nothing(redis_cluster):
    # A primary counts its replica online a moment after the replica says its link is up.
    assert await _settled(redis_cluster.url, lambda found: not found) == []


async def test_a_tls_clusters_check_reports_nothing(tmp_path):
    """The check reaches every node of a cluster over TLS (``rediss+cluster://``), as it
    does over plain TCP: each node's settings and replicas read, nothing to report."""
    cluster = RedisCluster(tmp_path / "cluster", tls=True)
    try:
        cluster.start()
        assert await _settled(cluster.url, lambda found: not found) == []
    finally:
        cluster.stop()


async def test_a_primary_whose_replica_is_gone_is_reported(tmp_path):
    cluster = RedisCluster(tmp_path / "cluster")
    try:
        cluster.start()
        primary = cluster.primary_of("k")
        replica = cluster.replica_of(primary)
        replica_port = replica.port
        replica.stop(signal.SIGKILL)
        found = await _settled(cluster.url, lambda f: any(x.setting == "replicas" for x in f))
        [finding] = [f for f in found if f.setting == "replicas"]
        assert finding.severity is Severity.WARNING  # a state the cluster heals: no refusal
        assert finding.line.startswith(f"primary 127.0.0.1:{primary.port} has no replica online")
        assert f"127.0.0.1:{replica_port}" in finding.line
        assert decide(found, "required", cluster.url).refusal is None
    finally:
        cluster.stop()


def test_a_worker_refuses_a_cluster_whose_primaries_have_no_replica(tmp_path, key_prefix):
    cluster = RedisCluster(tmp_path / "cluster", replicas=0)
    try:
        cluster.start()
        worker = _worker(tmp_path, Settings(redis_url=cluster.url, key_prefix=key_prefix))
        worker.start()
        assert worker.proc is not None
        assert worker.proc.wait(30) == 2
    finally:
        cluster.stop()
    [line] = [line for line in worker.log().splitlines() if not line.startswith("{")]
    assert line.startswith(f"error: Redis at {cluster.url} cannot keep acknowledged inputs: ")
    for node in cluster.nodes:
        assert f"primary 127.0.0.1:{node.port} has no replica: a write it acknowledged is " \
            "lost with it" in line  # fmt: skip


def _redis(port: int):
    import redis

    return redis.Redis(port=port, socket_timeout=2)


async def _settled(url: str, done, within_s: float = 10.0) -> list[Finding]:
    """The findings once ``done(findings)`` holds (a killed node takes a moment to be
    seen as gone)."""
    deadline = time.monotonic() + within_s
    while True:
        found = findings(await observe(url))
        if done(found) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)
