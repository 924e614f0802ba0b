"""Whether the data plane's Redis can keep an acknowledged input, read from Redis itself.

duplexq acknowledges an input once the script that appended it returned. That reply
means the input survives a crash of Redis only when Redis runs with ``appendonly yes``
and ``appendfsync always`` (``REDIS_PERSISTENCE``), keeps every key (``maxmemory-policy
noeviction``), and, on a Redis Cluster, when the primary has a replica to acknowledge
the script's ``WAIT 1`` (``dataplane.replicated``). Every process checks that at start
(``check_at_start``), so a Redis configured otherwise is never served silently.

Pure core (no I/O, tested on hand-built configurations): ``findings`` turns what Redis
said (``Observed``: each node's ``CONFIG GET *`` and ``INFO replication``, the cluster's
``CLUSTER NODES``) into ``Finding`` s, each with a severity and a one-line message naming
the setting, its value and what breaks; ``decide`` turns them into a ``Verdict`` under
``Settings.redis_durability``:

    finding                                             severity   required   relaxed
    appendonly not yes, appendfsync not always,         error      refuse     warn
    no-appendfsync-on-rewrite yes, an evicting
    maxmemory-policy, a cluster primary with no replica
    at all (and no node that may become one)
    a primary whose replica is down or syncing, or      warning    warn       warn
    none while a node down or without slots may
    become one (a failover in progress);
    repl-diskless-sync-delay > 0 on a cluster; CONFIG
    or CLUSTER NODES refused (managed Redis: the
    operator vouches); a node that does not answer

A primary's replicas are counted from its ``INFO replication`` (those online), or, where
``INFO`` is refused (an ACL user without ``@dangerous``), from ``CLUSTER NODES`` (those
not marked failed), as the script batches count them.

A primary left without its replica by a failover is a state the cluster heals (the old
primary rejoins as the replica), not a configuration: refusing then would turn one
node's loss into an outage of every process restarted meanwhile, so it is a warning,
and the writes acknowledged meanwhile are counted (``duplexq_unreplicated_writes_total``).

Thin shell: ``observe`` asks each node with a short timeout (a dead node is a warning,
not a hang), and ``check_at_start`` logs the warnings, sets the
``duplexq_redis_config_findings`` gauge and raises ``RedisRefused`` (a ``ConfigError``:
one line, exit code 2) for a refusal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from dataplane.bus import CLUSTER_SCHEMES
from dataplane.cluster import seed_nodes
from dataplane.cluster_nodes import Member, parse_cluster_nodes
from dataplane.config import RedisUnreachable, ensure_redis, redacted
from dataplane.metrics import REDIS_CONFIG_FINDINGS
from schemas.config import ConfigError, Settings

# -- the pure core ----------------------------------------------------------------------


class Severity(StrEnum):
    ERROR = "error"
    """The durability guarantee does not hold: the process refuses to start unless
    ``redis_durability`` is ``relaxed``."""
    WARNING = "warning"
    """Logged at start; never refused."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing Redis's configuration breaks or risks, in one line."""

    severity: Severity
    setting: str
    """The Redis setting (``appendfsync``), or what was read (``replicas``, ``CONFIG``)."""
    value: str
    """What Redis says it is."""
    message: str
    """The setting, its value and what breaks, in one sentence."""
    nodes: tuple[str, ...] = ()
    """The cluster nodes (``host:port``) it holds on; empty for the one Redis of a
    plain URL, or when the message names its node."""

    @property
    def line(self) -> str:
        return f"{self.message} (on {', '.join(self.nodes)})" if self.nodes else self.message


@dataclass(frozen=True, slots=True)
class NodeReport:
    """What one Redis node answered, or why it did not."""

    name: str
    """``host:port`` of a cluster node; empty for the one Redis of a plain URL."""
    config: Mapping[str, str] | None = None
    """Its ``CONFIG GET *``; None when refused (``config_error`` says how) or unreachable."""
    config_error: str = ""
    replication: Mapping[str, Any] | None = None
    """Its ``INFO replication`` as redis-py parses it (``slave0`` a mapping with
    ``state``); None when not asked or refused (``replication_error``)."""
    replication_error: str = ""
    unreachable: str = ""
    """Why the node did not answer at all; empty when it did."""


@dataclass(frozen=True, slots=True)
class Observed:
    """What the data plane's Redis said about itself."""

    cluster: bool
    nodes: tuple[NodeReport, ...]
    members: tuple[Member, ...] = ()
    """The cluster's nodes as ``CLUSTER NODES`` lists them (empty for one Redis)."""
    members_error: str = ""
    """Why ``CLUSTER NODES`` could not be read, on a cluster."""


def online_replicas(replication: Mapping[str, Any]) -> int:
    """Replicas ``INFO replication`` lists as ``online`` (a replica still syncing cannot
    acknowledge a ``WAIT``)."""
    count = 0
    for key, value in replication.items():
        if not (key.startswith("slave") and key[5:].isdigit()):
            continue
        state = value.get("state") if isinstance(value, Mapping) else None
        if state is None and isinstance(value, str):  # unparsed: ip=...,state=online,...
            state = dict(p.partition("=")[::2] for p in value.split(",")).get("state")
        count += state == "online"
    return count


_LOSES = "so a crash of Redis or its host loses inputs already acknowledged"


def config_findings(config: Mapping[str, str], *, cluster: bool) -> list[Finding]:
    """What one node's ``CONFIG GET *`` breaks or risks (settings it lacks are not judged)."""
    out: list[Finding] = []
    appendonly = config.get("appendonly")
    if appendonly is not None and appendonly != "yes":
        out.append(Finding(Severity.ERROR, "appendonly", appendonly,
                           f"appendonly is {appendonly}, not yes: Redis keeps no append-only "
                           f"file, {_LOSES}"))  # fmt: skip
    fsync = config.get("appendfsync")
    if appendonly == "yes" and fsync is not None and fsync != "always":
        out.append(Finding(Severity.ERROR, "appendfsync", fsync,
                           f"appendfsync is {fsync}, not always: Redis replies before its "
                           f"append-only file is on disk, {_LOSES}"))  # fmt: skip
    if appendonly == "yes" and config.get("no-appendfsync-on-rewrite") == "yes":
        out.append(Finding(Severity.ERROR, "no-appendfsync-on-rewrite", "yes",
                           "no-appendfsync-on-rewrite is yes, not no: Redis does not fsync "
                           f"while it rewrites its append-only file, {_LOSES}"))  # fmt: skip
    policy = config.get("maxmemory-policy")
    if policy is not None and policy != "noeviction":
        out.append(Finding(Severity.ERROR, "maxmemory-policy", policy,
                           f"maxmemory-policy is {policy}, not noeviction: a full Redis "
                           "deletes keys (session logs, fences, leases) behind the "
                           "runtime's back"))  # fmt: skip
    delay = config.get("repl-diskless-sync-delay", "0")
    if cluster and config.get("repl-diskless-sync") == "yes" and delay not in ("", "0"):
        out.append(Finding(Severity.WARNING, "repl-diskless-sync-delay", delay,
                           f"repl-diskless-sync-delay is {delay}, not 0: a primary waits "
                           f"{delay} s before it syncs a replica that (re)joins, and "
                           "acknowledges its writes without a replica's copy "
                           "meanwhile"))  # fmt: skip
    return out


def node_findings(report: NodeReport, *, cluster: bool) -> list[Finding]:
    """What one node's answers (or its silence) say, its name attached."""
    nodes = (report.name,) if report.name else ()
    if report.unreachable:
        who = "a node" if report.name else "Redis"
        return [Finding(Severity.WARNING, "node", "unreachable",
                        f"{who} did not answer ({report.unreachable}): its configuration "
                        "is not checked", nodes)]  # fmt: skip
    if report.config is None:
        return [Finding(Severity.WARNING, "CONFIG", "refused",
                        f"CONFIG GET is refused ({report.config_error}): duplexq cannot "
                        "check persistence and eviction and relies on the operator that "
                        "Redis runs with appendonly yes, appendfsync always and "
                        "maxmemory-policy noeviction", nodes)]  # fmt: skip
    found = config_findings(report.config, cluster=cluster)
    return [Finding(f.severity, f.setting, f.value, f.message, nodes) for f in found]


def replica_findings(members: Iterable[Member], reports: Iterable[NodeReport]) -> list[Finding]:
    """Whether every primary serving slots has a replica to acknowledge its ``WAIT 1``."""
    members = tuple(members)
    by_name = {report.name: report for report in reports}
    # Nodes that may yet become a replica: down ones, and primaries without slots (an old
    # primary back from a failover, before it turns into the new one's replica).
    spare = [m.name for m in members if m.down or (m.is_primary and not m.serves_slots)]
    out: list[Finding] = []
    for primary in members:
        if not (primary.is_primary and primary.serves_slots) or primary.down:
            continue
        report = by_name.get(primary.name)
        if report is None or report.unreachable:
            continue  # said by its node finding
        replicas = [m for m in members if m.primary_id == primary.id]
        if report.replication is not None:
            if online_replicas(report.replication) >= 1:
                continue
            unready = "down or syncing"
        else:
            # INFO refused (an ACL user without @dangerous): counted from CLUSTER NODES,
            # as the script batches count them then (dataplane.replica_count): those not
            # marked failed. Whether they finished syncing is not shown.
            if any(not m.down for m in replicas):
                continue
            unready = "down"
        listed = [m.name for m in replicas]
        meanwhile = "its writes are acknowledged without a replica's copy meanwhile"
        if listed:
            out.append(Finding(Severity.WARNING, "replicas", "0 online",
                               f"primary {primary.name} has no replica online "
                               f"({', '.join(listed)} {unready}): {meanwhile}"))  # fmt: skip
        elif spare:
            out.append(Finding(Severity.WARNING, "replicas", "0",
                               f"primary {primary.name} has no replica, and "
                               f"{', '.join(spare)} (down or without slots) may become one: "
                               f"{meanwhile}"))  # fmt: skip
        else:
            out.append(Finding(Severity.ERROR, "replicas", "0",
                               f"primary {primary.name} has no replica: a write it "
                               "acknowledged is lost with it"))  # fmt: skip
    return out


def findings(observed: Observed) -> list[Finding]:
    """Everything the observed configuration breaks or risks, errors first; a finding
    that holds on several nodes is one finding naming them all."""
    cluster = observed.cluster
    found = [f for report in observed.nodes for f in node_findings(report, cluster=cluster)]
    if cluster:
        for member in observed.members:
            if member.down:
                found.append(Finding(Severity.WARNING, "node", "failed",
                                     "a node is marked failed by the cluster: its "
                                     "configuration is not checked", (member.name,)))  # fmt: skip
        if observed.members_error:
            found.append(Finding(Severity.WARNING, "CLUSTER", "refused",
                                 f"CLUSTER NODES is refused ({observed.members_error}): "
                                 "replicas are not checked"))  # fmt: skip
        found += replica_findings(observed.members, observed.nodes)
    merged: dict[tuple[Severity, str, str, str], Finding] = {}
    for f in found:
        key = (f.severity, f.setting, f.value, f.message)
        seen = merged.get(key)
        merged[key] = f if seen is None else dataclasses.replace(seen, nodes=seen.nodes + f.nodes)
    return sorted(merged.values(), key=lambda f: f.severity is not Severity.ERROR)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a process does about the findings at start."""

    refusal: str | None
    """The one line a refusing process exits with; None: it starts."""
    warnings: tuple[str, ...] = field(default=())
    """Lines it logs as warnings."""


def decide(found: Iterable[Finding], durability: str, where: str) -> Verdict:
    """``durability`` is ``Settings.redis_durability``; ``where`` names the Redis (its URL
    without password)."""
    found = tuple(found)
    errors = [f.line for f in found if f.severity is Severity.ERROR]
    warnings = [f"Redis at {where}: {f.line}" for f in found if f.severity is Severity.WARNING]
    if errors and durability != "relaxed":
        return Verdict(
            f"Redis at {where} cannot keep acknowledged inputs: {'; '.join(errors)} "
            "(DUPLEXQ_REDIS_DURABILITY=relaxed runs on it anyway; docs/deploy.md)",
            tuple(warnings),
        )
    accepted = [f"Redis at {where}: {line} (accepted: redis_durability is relaxed)"
                for line in errors]  # fmt: skip
    return Verdict(None, (*accepted, *warnings))


# -- the shell --------------------------------------------------------------------------

NODE_TIMEOUT_S = 2.0
"""Longest one node is waited for: a dead cluster node is a warning, not a hang."""
WAIT_PAUSE_S = 1.0
"""Between two attempts to reach a Redis that does not answer yet (``wait``)."""

log = logging.getLogger("duplexq.redis")


class RedisRefused(ConfigError):
    """The data plane's Redis cannot keep acknowledged inputs and the settings require it."""


def node_url(base: str, host: str, port: int) -> str:
    """``base`` (scheme, credentials, TLS options) pointed at ``host:port``."""
    parts = urlsplit(base)
    userinfo, at, _ = parts.netloc.rpartition("@")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{address}"))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {NODE_TIMEOUT_S:g} s"
    return str(exc).strip() or type(exc).__name__


def _client(url: str) -> aioredis.Redis:
    client: aioredis.Redis = aioredis.Redis.from_url(
        url, socket_timeout=NODE_TIMEOUT_S, socket_connect_timeout=NODE_TIMEOUT_S
    )
    return client


async def read_node(url: str, name: str = "", *, replication: bool = False) -> NodeReport:
    """One node's ``CONFIG GET *`` (and ``INFO replication``)."""
    client = _client(url)
    config: dict[str, str] | None = None
    info: dict[str, Any] | None = None
    config_error = info_error = ""
    try:
        async with asyncio.timeout(NODE_TIMEOUT_S):
            try:
                config = dict(await client.config_get("*"))
            except ResponseError as exc:  # renamed away, or the ACL user may not
                config_error = _reason(exc)
            if replication:
                try:
                    info = dict(await client.info("replication"))
                except ResponseError as exc:
                    info_error = _reason(exc)
    except (TimeoutError, RedisError, OSError) as exc:
        return NodeReport(name, unreachable=_reason(exc))
    finally:
        await client.aclose()
    return NodeReport(name, config, config_error, info, info_error)


async def _cluster_nodes(plain: str, seeds: list[tuple[str, int]]) -> tuple[str, str, str]:
    """(``CLUSTER NODES``'s text, the host of the seed that answered, why none did)."""
    error = ""
    for host, port in seeds:
        client = _client(node_url(plain, host, port))
        try:
            async with asyncio.timeout(NODE_TIMEOUT_S):
                # Its text, for parse_cluster_nodes (the core reads it).
                reply = await client.execute_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call]
            return (reply.decode() if isinstance(reply, bytes) else str(reply)), host, ""
        except ResponseError as exc:  # refused: the other seeds would refuse it too
            return "", host, _reason(exc)
        except (TimeoutError, RedisError, OSError) as exc:
            error = _reason(exc)
        finally:
            await client.aclose()
    return "", "", error


async def observe(url: str) -> Observed:
    """Ask the Redis of ``url`` (every node of a ``redis+cluster://`` URL's cluster)."""
    if not url.startswith(CLUSTER_SCHEMES):
        return Observed(cluster=False, nodes=(await read_node(url),))
    plain, others = seed_nodes(url)
    first = urlsplit(plain)
    seeds = [(first.hostname or "127.0.0.1", first.port or 6379), *others]
    text, seed_host, error = await _cluster_nodes(plain, seeds)
    if not text:
        reports = await asyncio.gather(
            *(read_node(node_url(plain, h, p), f"{h}:{p}") for h, p in seeds)
        )
        return Observed(True, tuple(reports), members_error=error or "no seed answered")
    members = parse_cluster_nodes(text, seed_host)
    reports = await asyncio.gather(
        *(read_node(node_url(plain, m.host, m.port), m.name, replication=m.is_primary)
          for m in members if not m.down)
    )  # fmt: skip
    return Observed(True, tuple(reports), members)


async def check_at_start(
    settings: Settings,
    logger: logging.Logger = log,
    *,
    wait: bool = False,
    stopping: Callable[[], bool] | None = None,
) -> Verdict | None:
    """Check the data plane's Redis: log each warning, set the findings gauge, and
    raise RedisRefused when it cannot keep acknowledged inputs and
    ``settings.redis_durability`` requires it.

    A Redis that does not answer is RedisUnreachable; with ``wait`` (a long-running
    process, which may start before its Redis) that is logged once and the check waits
    for Redis instead, until ``stopping()`` says the process is stopping (None then)."""
    stopped = stopping or (lambda: False)
    said = False
    while True:
        try:
            await ensure_redis(settings.redis_url)
            break
        except RedisUnreachable as exc:
            if not wait:
                raise
            if not said:
                logger.error("%s; retrying", exc)
                said = True
        if stopped():
            return None
        await asyncio.sleep(WAIT_PAUSE_S)
        if stopped():
            return None
    found = findings(await observe(settings.redis_url))
    for finding in found:
        REDIS_CONFIG_FINDINGS.labels(finding.setting, finding.severity.value).inc()
    verdict = decide(found, settings.redis_durability, redacted(settings.redis_url))
    for line in verdict.warnings:
        logger.warning("%s", line)
    if verdict.refusal is not None:
        raise RedisRefused(verdict.refusal)
    return verdict
