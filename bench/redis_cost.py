"""What an append and a publish cost inside Redis, counted in instructions (no noise).

``python -m bench.redis_cost [--rounds 100]`` runs a redis-server under
valgrind's callgrind (it counts the instructions Redis executes, whatever
else the machine is doing) and drives a fixed load through the product's own
scripts: 64 open sessions of the echo pipeline, each held by a worker's lease,
then ``--rounds`` rounds in which every session appends one 40 ms audio chunk
(``SessionAuthority.append``) and, in a second run, also publishes two echoed
outputs (``StageOwnership.publish``), the sessions' calls made concurrently so
that they go in batches as they do under load. Three runs (no round, appends
only, appends and publishes) give the instructions of one append and of one
publish of two outputs by difference; start-up and shutdown cancel out.

Redis under valgrind runs some 50 times slower, so its batches hold more
calls than on a live system: the figures compare versions of the scripts with
each other (they repeat to about 0.5 % from run to run), they are not a
latency. Needs Debian's ``valgrind``. Results go to ``bench/redis_cost.json``;
docs/scaling.md quotes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.common import ROOT, free_port
from bench.load import chunk
from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from schemas.config import echo_pipeline
from schemas.events import InputMode, OutputEvent, OutputKind
from schemas.keys import Keys
from workers.ownership import Lease, StageOwnership

SESSIONS = 64
PIPELINE = echo_pipeline("echo")


class CountedRedis:
    """A redis-server under callgrind, on a free port in a temp dir, no persistence."""

    def __init__(self, workdir: Path) -> None:
        valgrind, server = shutil.which("valgrind"), shutil.which("redis-server")
        if valgrind is None or server is None:
            raise RuntimeError("needs valgrind and redis-server (apt-get install valgrind)")
        self.port = free_port()
        self.out = workdir / "callgrind.out"
        args = [
            valgrind, "--tool=callgrind", f"--callgrind-out-file={self.out}", server,
            "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(workdir),
            "--save", "", "--appendonly", "no",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("redis-server under valgrind did not start within 60 s")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def instructions(self) -> int:
        """Stop the server and read the instructions it executed in all."""
        self.proc.terminate()
        self.proc.wait(120)
        totals = re.search(r"^(?:summary|totals): (\d+)", self.out.read_text(), re.MULTILINE)
        if totals is None:
            raise RuntimeError(f"no totals in {self.out}")
        return int(totals.group(1))


async def drive(url: str, rounds: int, publish: bool) -> None:
    """Open the sessions, take their leases, then ``rounds`` rounds of one append each
    (and one publish of two outputs each, with ``publish``)."""
    bus = RedisBus(url, Keys("cost"))
    try:
        authority = SessionAuthority(bus, PIPELINE)
        owner = StageOwnership(bus, PIPELINE, "echo", "w1", 600_000)
        leases: dict[str, Lease] = {}
        for i in range(SESSIONS):
            sid = f"s{i}"
            await authority.open(sid)
            _, lease = await owner.acquire(sid, 0)
            assert lease is not None
            leases[sid] = lease

        async def session(sid: str) -> None:
            lease = leases[sid]
            for n in range(1, rounds + 1):
                sound = chunk(0, n)
                await authority.append(sid, InputMode.APPEND_AUDIO_CHUNK, sound)
                if not publish:
                    continue
                outputs = [
                    OutputEvent(lease.fence, "echo", OutputKind.AUDIO_DELTA, 2 * n - k, n,
                                data=sound.data, meta={"source": n, "chunk": 0, "last": True})
                    for k in (1, 0)
                ]  # fmt: skip
                result = await owner.publish(
                    lease, [(lease.fence, outputs)], applied_seq=n, read_id=f"{n}-0", out_seq=2 * n
                )
                assert result.status == "ok", result

        await asyncio.gather(*(session(sid) for sid in leases))
    finally:
        await bus.aclose()


def run_once(rounds: int, publish: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="duplexq-redis-cost-") as workdir:
        server = CountedRedis(Path(workdir))
        try:
            asyncio.run(drive(server.url, rounds, publish))
        except BaseException:
            server.proc.kill()
            raise
        return server.instructions()


def measure(rounds: int) -> dict[str, Any]:
    base = run_once(0, publish=False)
    appends = run_once(rounds, publish=False)
    both = run_once(rounds, publish=True)
    calls = rounds * SESSIONS
    return {
        "rounds": rounds,
        "sessions": SESSIONS,
        "instructions": {"start_and_stop": base, "appends": appends, "appends_and_publishes": both},
        "per_append": round((appends - base) / calls),
        "per_publish_of_two_outputs": round((both - appends) / calls),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.redis_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "redis_cost.json")
    args = parser.parse_args(argv)
    result = measure(args.rounds)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
