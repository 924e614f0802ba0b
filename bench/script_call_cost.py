"""What Redis spends on one append, by how calls are grouped and where Redis runs.

``python -m bench.script_call_cost [--appends 4000]``: one client appends a 1.3 KB text
through the product's own ``SessionAuthority.append``, the calls of one round made
concurrently so that they go as one call of the append's multi form (one script call,
``dataplane.batching``), on private redis-servers without persistence:

- on a plain Redis, with 1, 2, 4, 8, 16 and 32 appends per script call: what entering
  Lua costs on its own, beside what each append costs;
- with 8 appends per call, on a plain Redis, on one with a replica attached, and on a
  node in cluster mode serving every slot (its appends are sessions of one partition,
  so that a call holds 8 of them there too): whether the replica's feed or cluster
  mode makes an append dearer.

The figure is Redis's command time per append (INFO commandstats, EVALSHA's usec over
the appends): wall time inside Redis, so it is meant for a quiet machine; with one
client it is not inflated by other busy processes, as under a saturated benchmark.
docs/scaling.md quotes it. Not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import PrivateRedis
from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from schemas.config import echo_pipeline
from schemas.events import InputMode, TextPayload
from schemas.keys import Keys, partition_of

TEXT = TextPayload("x" * 1300)


def evalsha_usec(server: PrivateRedis) -> tuple[int, int]:
    """(calls, usec) of EVALSHA so far."""
    for line in server.command(b"INFO", b"commandstats").decode().splitlines():
        if line.startswith("cmdstat_evalsha:"):
            calls = int(line.split("calls=")[1].split(",")[0])
            return calls, int(line.split("usec=")[1].split(",")[0])
    return 0, 0


def one_partition(count: int) -> list[str]:
    """``count`` session ids of one partition (one cluster slot)."""
    ids: list[str] = []
    number = 0
    while len(ids) < count:
        if partition_of(f"s{number}") == 3:
            ids.append(f"s{number}")
        number += 1
    return ids


async def per_append(
    url: str, server: PrivateRedis, per_call: int, appends: int, prefix: str
) -> str:
    """Redis's time per append with ``per_call`` appends per script call (sessions opened
    under keys of ``prefix``)."""
    bus = RedisBus(url, Keys(prefix))
    try:
        authority = SessionAuthority(bus, echo_pipeline("echo"))
        ids = one_partition(per_call)
        for session_id in ids:
            await authority.open(session_id)

        async def round_of_appends() -> None:
            await asyncio.gather(*(authority.append(s, InputMode.APPEND_TEXT, TEXT) for s in ids))

        for _ in range(20):  # scripts loaded, connections made
            await round_of_appends()
        calls0, usec0 = evalsha_usec(server)
        rounds = appends // per_call
        for _ in range(rounds):
            await round_of_appends()
        calls1, usec1 = evalsha_usec(server)
    finally:
        await bus.aclose()
    usec, calls = usec1 - usec0, calls1 - calls0
    return (f"{usec / (rounds * per_call):6.2f} us per append, {usec / calls:6.1f} us per "
            f"script call ({calls} calls)")  # fmt: skip


def _wait_for(server: PrivateRedis, section: bytes, text: bytes) -> None:
    deadline = time.monotonic() + 10
    while text not in server.command(b"INFO" if section != b"CLUSTER" else b"CLUSTER",
                                     section if section != b"CLUSTER" else b"INFO"):  # fmt: skip
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server on {server.port}: no {text!r} after 10 s")
        time.sleep(0.05)


async def run(appends: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="duplexq-bench-script-cost-"))
    servers: list[PrivateRedis] = []
    try:
        plain = PrivateRedis(work / "plain", persistent=False).start()
        servers.append(plain)
        print("a plain Redis, by appends per script call:", flush=True)
        for per_call in (1, 2, 4, 8, 16, 32):
            cost = await per_append(plain.url, plain, per_call, appends, f"k{per_call}")
            print(f"  {per_call:2d}: {cost}", flush=True)
        primary = PrivateRedis(work / "primary", persistent=False).start()
        replica_of = ["--replicaof", "127.0.0.1", str(primary.port)]
        replica = PrivateRedis(work / "replica", extra=replica_of, persistent=False).start()
        servers += [primary, replica]
        _wait_for(primary, b"replication", b"connected_slaves:1")
        cluster_mode = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        node = PrivateRedis(work / "node", extra=cluster_mode, persistent=False).start()
        servers.append(node)
        node.command(b"CLUSTER", b"ADDSLOTSRANGE", b"0", b"16383")
        _wait_for(node, b"CLUSTER", b"cluster_state:ok")
        print("8 appends per script call:", flush=True)
        for name, url, server in (
            ("a plain Redis", plain.url, plain),
            ("a Redis with a replica", primary.url, primary),
            ("a cluster-mode node", f"redis+cluster://127.0.0.1:{node.port}", node),
        ):
            cost = await per_append(url, server, 8, appends, "eight")
            print(f"  {name}: {cost}", flush=True)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=4000)
    asyncio.run(run(parser.parse_args().appends))


if __name__ == "__main__":
    main()
