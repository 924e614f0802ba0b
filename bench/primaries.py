"""10. One Redis or a Redis Cluster: throughput with 1 and 3 primaries, side by side.

``python -m bench --only primaries``: one echo worker driven to saturation (as
section 3) on the section's single Redis, then on a private Redis Cluster of 3
primaries with a replica each (six redis-server processes, with the shipped
persistence as every benchmark Redis). On the cluster every script is
acknowledged once a replica has its writes (each primary's batch of scripts
closed by one ``WAIT 1``, ``dataplane/replicated.py``) and reads are split per
slot: the figure is what those cost, and the CPU of all six nodes is counted. On
a 2-core machine more primaries cannot add capacity (they share the same cores
as everything else); what a cluster buys is room beyond one Redis core on a
bigger machine, and survival of a node's loss.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import BenchRedis, PrivateRedis, cpu_of, ratio
from bench.mdformat import f, failed, table, x
from bench.throughput import saturated
from chaos.cluster import cluster_port

NODES = 6
CLUSTER_OPTIONS = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", "2000"]  # fmt: skip


class PrivateCluster:
    """Six private redis-server nodes joined as 3 primaries with a replica each."""

    def __init__(self, workdir: Path, nodes: int = NODES) -> None:
        self.nodes = [PrivateRedis(workdir / f"node{i}", extra=CLUSTER_OPTIONS)
                      for i in range(nodes)]  # fmt: skip
        for node in self.nodes:
            node.port = cluster_port()

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def pids(self) -> dict[str, int]:
        return {f"redis node {i}": node.pid for i, node in enumerate(self.nodes)}

    @property
    def persistent(self) -> bool:
        return all(node.persistent for node in self.nodes)

    def start(self) -> PrivateCluster:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (scripts/setup installs it)")
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_ok()
        return self

    def wait_ok(self) -> None:
        """Wait until every node says the cluster is ok (30 s at most)."""
        deadline = time.monotonic() + 30
        while not all(b"cluster_state:ok" in n.command(b"CLUSTER", b"INFO") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark's Redis Cluster is not ok after 30 s")
            time.sleep(0.1)

    def flush(self) -> None:
        for node in self.nodes:  # replicas refuse it (READONLY); primaries pass it on
            node.command(b"FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def private_cluster() -> Iterator[PrivateCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="duplexq-bench-cluster-"))
    cluster = PrivateCluster(workdir)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def _point(server: BenchRedis, name: str, primaries: int, plan: Any, log_dir: Path,
                 batched: float) -> dict[str, Any]:  # fmt: skip
    point = await saturated(server, log_dir, name, 1, plan)
    point["primaries"] = primaries
    point["ratio_to_raw_batched"] = ratio(point["events_per_s"], batched)
    print(f"  {primaries} primar{'y' if primaries == 1 else 'ies'}: "
          f"{point['events_per_s']:.0f} ev/s, {point['cpu_us_per_event']['total']:.0f} us "
          "CPU per event", flush=True)  # fmt: skip
    return point


async def run(
    server: PrivateRedis, plan: Any, raw: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    batched = raw["batched"]["events_per_s"]
    single = await _point(server, "prim1", 1, plan, log_dir, batched)
    with private_cluster() as cluster:
        clustered = await _point(cluster, "prim3", 3, plan, log_dir, batched)
    clustered["ratio_to_one_primary"] = ratio(clustered["events_per_s"], single["events_per_s"])
    return {"reference_batched_eps": batched, "points": [single, clustered]}


def summary_rows(s: dict[str, Any] | None) -> list[list[Any]]:
    """The summary table's rows for section 10."""
    points = (s or {}).get("points", [])
    if len(points) < 2:
        return []
    one, three = points
    return [
        ["10", "throughput, 1 echo worker, 3 primaries (replica-acknowledged)",
         f"{f(three['events_per_s'], 0)} ev/s", f"1 Redis {f(one['events_per_s'], 0)} ev/s",
         x(three.get("ratio_to_one_primary"))],
    ]  # fmt: skip


def section(s: dict[str, Any] | None) -> str:
    """The report's section 10."""
    out = ["## 10. One Redis or a Redis Cluster", ""]
    if (msg := failed("primaries", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    out.append(
        "One echo worker driven to saturation (as section 3) on one Redis, then on a private\n"
        "Redis Cluster of 3 primaries with a replica each. On the cluster every script waits\n"
        "for a replica's acknowledgement (one `WAIT 1` closes each primary's batch of\n"
        "scripts) and reads are split per slot; CPU counts all six nodes. On this machine\n"
        "the nodes share its cores with everything else, so\n"
        "more primaries cannot add capacity here; on a machine with a core per node the data\n"
        "plane's Redis work spreads over the primaries instead of one core.\n"
    )
    rows = []
    for p in s["points"]:
        cpu = p["cpu_us_per_event"]
        redis_us = cpu_of(cpu, "redis")
        rows.append([f(p["primaries"]), f"{f(p['events_per_s'], 0)} ev/s",
                     x(p["ratio_to_raw_batched"]), f"{f(cpu['total'], 0)} us",
                     f"{f(redis_us, 0)} us"])  # fmt: skip
    out.append(table(["primaries", "events/s", "vs raw batched", "CPU per event, all",
                      "of which Redis"], rows))  # fmt: skip
    return "\n".join(out)
