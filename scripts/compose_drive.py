"""Drives duplexq's docker-compose stack from outside, as a user would.

``scripts/compose-test`` runs this once the image is built and a Docker daemon
answers on ``DOCKER_HOST``; the variables it sets (``DUPLEXQ_IMAGE``,
``DUPLEXQ_REDIS_IMAGE``, ``DUPLEXQ_MODELS``) pick the images and the models
folder, everything else is docker-compose.yml's defaults. Each step is timed
and checked; the first failed check ends the run with its reason:

1. ``docker-compose up -d`` with the default CPU pipeline; every service's
   healthcheck turns healthy, none restarts;
2. a typed turn through the published port with the official ``openai`` SDK,
   answered in words (the default thinker, SmolLM2, on vLLM);
3. a barge-in mid-answer: after ``duplexq.response.cancelled`` no event of the
   cancelled epoch arrives, and the next turn is answered;
4. ``docker-compose up --scale tts=3``: three healthy tts containers; every
   container of every worker service serves its metrics on port 9100, found
   by its service name as configs/prometheus.yml finds it;
5. ``docker kill`` of the tts container holding the session: the session's
   next answer comes, with speech, from another container;
6. ``docker-compose restart redis``: every input entry acknowledged before
   is still in the session's log, the session answers again, and none of its
   stages failed over (Redis was down for well under a lease's TTL);
7. the echo profile's stack (its own coordinator, on the port the default
   one had) answers a turn;
8. the echo profile's stack on the cluster profile's Redis Cluster, set up as
   docs/deploy.md says (six nodes joined by the one-shot ``redis-cluster``):
   a turn is answered; ``docker kill`` of the primary serving the session: its
   replica is promoted, every input acknowledged before is kept, and the session
   answers again;
9. ``docker-compose down``: no container of the project is left.

``--only echo,cluster`` runs only those steps (``default`` is steps 1-6).

Only 127.0.0.1 is contacted: the coordinator's published port. Redis is read
with ``docker-compose exec redis redis-cli`` (it is not published).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from schemas.config import load_pipeline
from schemas.keys import Keys

API_KEY = "compose-test-key"
DEFAULT = "configs/default.toml"
HEALTHY_WITHIN_S = 900.0
"""Cold start on a small CPU machine: vLLM and Whisper load from scratch."""
ANSWER_WITHIN_S = 180.0
WORD = re.compile(r"[A-Za-z]{2,}")


class Failed(Exception):
    """A check of the drive did not hold."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Stack:
    """docker-compose and docker on one project, with the environment it runs in."""

    project: str
    docker: str
    port: int
    pipeline: str = DEFAULT
    rounds: int = 1
    """How many times the kill and the Redis restart are done, one after the other."""
    watched: str = ""
    """The session whose state in Redis a failure report shows."""
    killed: set[str] = field(default_factory=set)
    """Containers the drive killed: their restart policy may bring them back."""
    figures: dict[str, str] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)
    """More variables for docker-compose (the cluster profile's URLs)."""

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DUPLEXQ_PIPELINE=self.pipeline,
            DUPLEXQ_PUBLISH_PORT=str(self.port),
            DUPLEXQ_ECHO_PUBLISH_PORT=str(self.port),
            DUPLEXQ_API_KEYS=API_KEY,
            **self.extra,
        )
        return env

    async def run(self, *argv: str) -> str:
        """``argv``'s output; it must succeed. The event loop goes on meanwhile (the
        sessions' WebSocket keepalives with it)."""
        proc = await asyncio.create_subprocess_exec(
            *argv, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise Failed(f"{' '.join(argv)} failed: {err.decode()}")
        return out.decode(errors="replace")  # redis-cli prints binary fields as they are

    async def compose(self, *args: str) -> str:
        return await self.run("docker-compose", "-p", self.project, *args)

    async def containers(self, service: str | None = None) -> list[dict[str, Any]]:
        """``docker inspect`` of the project's containers (of one service)."""
        ids = (await self.compose("ps", "-q", *([service] if service else []))).split()
        return json.loads(await self.run(self.docker, "inspect", *ids)) if ids else []

    async def wait_healthy(self, expected: dict[str, int]) -> float:
        """Seconds until each service has ``expected`` healthy containers; none may
        restart meanwhile (a crash loop)."""
        start = time.monotonic()
        while True:
            counts: dict[str, int] = {}
            states = []
            for c in await self.containers():
                service = c["Config"]["Labels"]["com.docker.compose.service"]
                health = c["State"].get("Health", {}).get("Status", "none")
                states.append(f"{c['Name'].lstrip('/')}={c['State']['Status']}/{health}")
                if c["RestartCount"] and c["Id"] not in self.killed:
                    logs = await self.run(self.docker, "logs", "--tail", "30", c["Id"])
                    raise Failed(f"{c['Name']} restarted:\n{logs}")
                if health == "healthy":
                    counts[service] = counts.get(service, 0) + 1
            if all(counts.get(s, 0) >= n for s, n in expected.items()):
                return time.monotonic() - start
            if time.monotonic() - start > HEALTHY_WITHIN_S:
                raise Failed(f"not healthy within {HEALTHY_WITHIN_S:.0f} s: {' '.join(states)}")
            await asyncio.sleep(2)

    async def redis(self, *args: str) -> str:
        return await self.compose("exec", "-T", "redis", "redis-cli", "--raw", *args)


class Session:
    """One Realtime session through the official SDK, read as raw JSON events."""

    def __init__(self, port: int) -> None:
        self.client = AsyncOpenAI(api_key=API_KEY, websocket_base_url=f"ws://127.0.0.1:{port}/v1")
        self.seen: list[dict[str, Any]] = []
        self.id = ""

    async def __aenter__(self) -> Session:
        self._exit = contextlib.AsyncExitStack()
        self._exit.push_async_callback(self.client.close)
        self.connection = await self._exit.enter_async_context(
            self.client.realtime.connect(model="duplexq")
        )
        created = await self.until("session.created")
        self.id = created["session"]["id"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._exit.aclose()

    async def until(self, *kinds: str, within_s: float = ANSWER_WITHIN_S) -> dict[str, Any]:
        """The next event of one of ``kinds`` (every event is kept in ``seen``)."""
        mark = len(self.seen)
        try:
            async with asyncio.timeout(within_s):
                while True:
                    event: dict[str, Any] = json.loads(await self.connection.recv_bytes())
                    event["_at"] = time.monotonic()
                    self.seen.append(event)
                    if event["type"] == "error":
                        raise Failed(f"server error: {event['error']}")
                    if event["type"] in kinds:
                        return event
        except TimeoutError:
            came = [e["type"] for e in self.seen[mark:]]
            raise Failed(
                f"no {' or '.join(kinds)} within {within_s:.0f} s; came meanwhile: {came[-20:]}"
            ) from None

    async def ask(self, text: str) -> float:
        """Sends a typed turn and asks for a response; the time it was sent."""
        await self.connection.conversation.item.create(
            item={"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": text}]}
        )  # fmt: skip
        await self.connection.response.create()
        return time.monotonic()

    async def answer(self, text: str) -> tuple[str, float, list[dict[str, Any]]]:
        """A completed answer to ``text``: its words, seconds to its first output,
        and its events."""
        mark = len(self.seen)
        sent = await self.ask(text)
        done = await self.until("response.done")
        # A response the pipeline began before this one (the echo pipeline answers
        # the item itself) ends superseded by it.
        while reason(done) == "superseded":
            done = await self.until("response.done")
        if done["response"]["status"] != "completed":
            raise Failed(f"response {done['response']['status']}: {done['response']}")
        events = self.seen[mark:]
        outputs = [e for e in events if e["type"] in OUTPUT_DELTAS]
        if not outputs:
            raise Failed(f"no output for {text!r}")
        return words(events), outputs[0]["_at"] - sent, events


OUTPUT_DELTAS = (
    "response.output_text.delta",
    "response.output_audio_transcript.delta",
    "response.output_audio.delta",
)


def reason(done: dict[str, Any]) -> str | None:
    """duplexq's reason a ``response.done`` gives for its status, if any."""
    details = done["response"].get("status_details") or {}
    return (details.get("duplexq") or {}).get("reason")


def words(events: list[dict[str, Any]]) -> str:
    text = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    if not text:
        text = [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"]
    return "".join(text).strip()


def check_words(answer: str) -> None:
    if len(WORD.findall(answer)) < 2:
        raise Failed(f"the answer is not in words: {answer!r}")


async def typed_turn(stack: Stack, up_at: float) -> None:
    async with Session(stack.port) as session:
        answer, first_s, _ = await session.answer("What is the capital of France?")
    check_words(answer)
    print(f"typed turn answered: {answer!r}")
    stack.figures["turn end to first output"] = f"{first_s:.2f} s"
    stack.figures["`up -d` to first answer"] = f"{time.monotonic() - up_at:.0f} s"


async def barge_in(session: Session, stack: Stack) -> None:
    mark = len(session.seen)
    await session.ask("Tell me a long story about a dragon and a knight.")
    first = await session.until(*OUTPUT_DELTAS)
    await session.connection.send_raw(json.dumps({"type": "duplexq.barge_in"}))
    cancelled = await session.until("duplexq.response.cancelled")
    cut = [e for e in session.seen[mark:] if e["type"] in OUTPUT_DELTAS]
    epoch = cancelled["duplexq"]["fence"]["epoch"]
    stale_response = first["response_id"]
    answer, first_s, after = await session.answer("Say hello.")
    check_words(answer)
    stack.figures["turn end to first output, engine started"] = f"{first_s:.2f} s"
    stale = [
        e for e in after
        if e.get("response_id") == stale_response
        or (e["type"] in OUTPUT_DELTAS and e["duplexq"]["fence"]["epoch"] < epoch)
    ]  # fmt: skip
    if stale:
        raise Failed(f"{len(stale)} stale events after the barge-in, first {stale[0]}")
    print(f"barge-in: the answer cut after {len(cut)} output deltas; the next: {answer!r}")


SCRAPE = """
import socket, sys, urllib.request
for name in sys.argv[1:]:
    infos = socket.getaddrinfo(name, 9100, socket.AF_INET, socket.SOCK_STREAM)
    for addr in sorted({info[4][0] for info in infos}):
        body = urllib.request.urlopen(f"http://{addr}:9100/metrics", timeout=5).read()
        samples = [l for l in body.decode().splitlines() if l.startswith("duplexq_")]
        print(name, addr, len(samples))
"""


async def worker_metrics(stack: Stack, expected: dict[str, int]) -> None:
    """From inside the project network (the coordinator's container), each worker
    service's name resolves to ``expected`` addresses, each serving duplexq's metrics
    on port 9100: what configs/prometheus.yml scrapes."""
    out = await stack.compose("exec", "-T", "coordinator", "python", "-c", SCRAPE, *expected)
    found: dict[str, int] = {}
    for line in out.split("\n"):
        if line.strip():
            service, addr, samples = line.split()
            if int(samples) == 0:
                raise Failed(f"{service} at {addr} serves no duplexq metric")
            found[service] = found.get(service, 0) + 1
    if found != expected:
        raise Failed(f"worker metrics endpoints {found}, expected {expected}")
    print(f"worker metrics scraped on port 9100: {found}")


async def lease_owner(stack: Stack, session_id: str, stage: str) -> tuple[str, int]:
    """(container host name, incarnation) of the worker holding (session, stage)."""
    value = (await stack.redis("GET", Keys().session(session_id).lease(stage))).strip()
    if not value:
        raise Failed(f"no {stage} lease for session {session_id}")
    worker, _token, incarnation = value.split()
    return worker.split("-")[0], int(incarnation)


async def kill_owner(session: Session, stack: Stack) -> None:
    stage = "tts"
    owner, incarnation = await lease_owner(stack, session.id, stage)
    victims = [c for c in await stack.containers(stage) if c["Config"]["Hostname"] == owner]
    if not victims:
        raise Failed(f"no {stage} container with host name {owner}")
    victim = victims[0]["Name"].lstrip("/")
    stack.killed.add(victims[0]["Id"])
    await stack.run(stack.docker, "kill", victims[0]["Id"])
    killed_at = time.monotonic()
    answer, _, events = await session.answer("Name a color.")
    check_words(answer)
    audio = [e for e in events if e["type"] == "response.output_audio.delta"]
    if not audio:
        raise Failed("no speech after the tts container was killed")
    new_owner, new_incarnation = await lease_owner(stack, session.id, stage)
    if new_owner == owner or new_incarnation <= incarnation:
        raise Failed(f"the session stayed with {owner} (incarnation {new_incarnation})")
    failover_s = audio[0]["_at"] - killed_at
    stack.figures["failover (kill to first speech)"] = f"{failover_s:.1f} s"
    print(f"killed {victim}: session went on on {new_owner}, speech {failover_s:.1f} s later")


async def input_ids(stack: Stack, session_id: str) -> list[str]:
    out = await stack.redis("XRANGE", Keys().session(session_id).input, "-", "+")
    return [line for line in out.splitlines() if re.fullmatch(r"\d+-\d+", line)]


async def incarnation(stack: Stack, session_id: str) -> int:
    return int((await stack.redis("HGET", Keys().session(session_id).meta, "inc")).strip())


async def restart_redis(session: Session, stack: Stack) -> None:
    """Redis restarted (down well under a lease's TTL): nothing acknowledged is lost, the
    session answers, and no stage of it failed over (its incarnation is unchanged)."""
    before = await input_ids(stack, session.id)
    held = await incarnation(stack, session.id)
    start = time.monotonic()
    print(f"restarting Redis at {time.strftime('%H:%M:%S', time.gmtime())} UTC")
    await stack.compose("restart", "redis")
    answer, _, _ = await session.answer("Say one more word.")
    check_words(answer)
    lost = set(before) - set(await input_ids(stack, session.id))
    if lost:
        raise Failed(f"{len(lost)} acknowledged inputs lost across the Redis restart")
    if (now := await incarnation(stack, session.id)) != held:
        raise Failed(f"the Redis restart failed the session over (incarnation {held} -> {now})")
    stack.figures["Redis restart to next answer"] = f"{time.monotonic() - start:.1f} s"
    print(f"Redis restarted: {len(before)} inputs kept, next answer {answer!r}")


async def default_pipeline(stack: Stack) -> None:
    services = {"redis": 1, "coordinator": 1, "control": 1, "vad": 1, "asr": 1,
                "thinker": 1, "tts": 1}  # fmt: skip
    up_at = time.monotonic()
    await stack.compose("up", "-d", "--no-build")
    healthy_s = await stack.wait_healthy(services)
    stack.figures["`up -d` to every service healthy"] = f"{healthy_s:.0f} s"
    print(f"default pipeline healthy in {healthy_s:.0f} s")
    await typed_turn(stack, up_at)
    async with Session(stack.port) as session:
        stack.watched = session.id
        await barge_in(session, stack)
        await stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "tts=3")
        scaled_s = await stack.wait_healthy({**services, "tts": 3})
        stack.figures["`--scale tts=3` to healthy"] = f"{scaled_s:.0f} s"
        print(f"tts scaled to 3 in {scaled_s:.0f} s")
        await worker_metrics(stack, {"vad": 1, "asr": 1, "thinker": 1, "tts": 3})
        for round_ in range(stack.rounds):
            if round_:  # the killed container back, for the next kill
                await stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "tts=3")
                await stack.wait_healthy({**services, "tts": 3})
                print(f"round {round_ + 1} of {stack.rounds}")
            await kill_owner(session, stack)
            await restart_redis(session, stack)
    await stack.compose("down", "--volumes", "--timeout", "10")


async def echo_profile(stack: Stack) -> None:
    """The echo profile's own stack, alone: it runs configs/echo.toml whatever
    DUPLEXQ_PIPELINE says."""
    services = ["echo-coordinator", "echo-control", "echo-thinker", "echo-talker"]
    await stack.compose("--profile", "echo", "up", "-d", "--no-build", *services)
    healthy_s = await stack.wait_healthy({"redis": 1, **dict.fromkeys(services, 1)})
    async with Session(stack.port) as session:
        answer, _, _ = await session.answer("echo me")
    if "echo me" not in answer:
        raise Failed(f"the echo pipeline answered {answer!r}")
    print(f"echo profile healthy in {healthy_s:.0f} s and answered {answer!r}")
    await stack.compose("--profile", "echo", "down", "--volumes", "--timeout", "10")


CLUSTER_ENV = {
    "DUPLEXQ_REDIS_URL": "redis+cluster://redis-node-0:6379,redis-node-1:6379,redis-node-2:6379",
    "DUPLEXQ_CONTROL_REDIS_URL": "redis://redis:6379/0",
}
"""The variables docs/deploy.md sets for the cluster profile."""

NODES = [f"redis-node-{i}" for i in range(6)]
ECHO_KEYS = Keys("dq-echo")
"""The echo profile's keys (its services' ``DUPLEXQ_KEY_PREFIX``)."""


async def node_cli(stack: Stack, node: str, *args: str) -> str:
    """``redis-cli`` in a node's container, following the cluster's redirections."""
    return await stack.compose("exec", "-T", node, "redis-cli", "-c", "--raw", *args)


async def primary_of(stack: Stack, key: str, ask: str) -> str:
    """The service name of the node serving ``key`` now, as node ``ask`` sees it (the
    nodes announce their service names)."""
    slot = int((await node_cli(stack, ask, "CLUSTER", "KEYSLOT", key)).strip())
    for line in (await node_cli(stack, ask, "CLUSTER", "NODES")).splitlines():
        fields = line.split()
        if "master" not in fields[2] or "fail" in fields[2]:
            continue
        for part in fields[8:]:
            start, _, end = part.partition("-")
            if start.isdigit() and int(start) <= slot <= int(end or start):
                return fields[1].split(",", 1)[1]  # ip:port@bus,hostname
    raise Failed(f"no primary serves slot {slot}")


async def cluster_inputs(stack: Stack, session_id: str, ask: str) -> list[str]:
    out = await node_cli(stack, ask, "XRANGE", ECHO_KEYS.session(session_id).input, "-", "+")
    return [line for line in out.splitlines() if re.fullmatch(r"\d+-\d+", line)]


async def cluster_profile(stack: Stack) -> None:
    """The echo profile's stack on the cluster profile's Redis Cluster: a turn answered;
    the primary serving the session killed, its replica promoted, every acknowledged input
    kept, and the next turn answered."""
    stack.extra = dict(CLUSTER_ENV)
    services = ["echo-coordinator", "echo-control", "echo-thinker", "echo-talker"]
    await stack.compose("--profile", "echo", "--profile", "cluster", "up", "-d", "--no-build",
                        "redis", *NODES, "redis-cluster", *services)  # fmt: skip
    healthy_s = await stack.wait_healthy(
        {"redis": 1, **dict.fromkeys(NODES, 1), **dict.fromkeys(services, 1)}
    )
    async with Session(stack.port) as session:
        stack.watched = ""  # session_state reads the plain Redis: not this session's
        answer, _, _ = await session.answer("on a cluster")
        if "on a cluster" not in answer:
            raise Failed(f"the echo pipeline on the cluster answered {answer!r}")
        meta = ECHO_KEYS.session(session.id).meta
        victim = await primary_of(stack, meta, "redis-node-0")
        ask = next(node for node in NODES if node != victim)
        before = await cluster_inputs(stack, session.id, ask)
        if not before:
            raise Failed(f"no input of session {session.id} found on the cluster")
        [container] = await stack.containers(victim)
        stack.killed.add(container["Id"])
        await stack.run(stack.docker, "kill", container["Id"])
        killed_at = time.monotonic()
        again, _, _ = await session.answer("after the kill")
        if "after the kill" not in again:
            raise Failed(f"after {victim} was killed the pipeline answered {again!r}")
        answered_s = time.monotonic() - killed_at
        promoted = await primary_of(stack, meta, ask)
        lost = set(before) - set(await cluster_inputs(stack, session.id, ask))
        if lost:
            raise Failed(f"{len(lost)} acknowledged inputs lost with {victim}")
    stack.figures["cluster: kill of the session's primary to the next answer"] = (
        f"{answered_s:.1f} s"
    )
    print(f"cluster profile healthy in {healthy_s:.0f} s and answered {answer!r}; killed "
          f"{victim}: {promoted} serves the session, {len(before)} inputs kept, "
          f"answered again {answered_s:.1f} s later")  # fmt: skip
    await stack.compose("--profile", "echo", "--profile", "cluster", "down", "--volumes",
                        "--timeout", "10")  # fmt: skip
    stack.extra = {}


async def show_logs(stack: Stack) -> None:
    """After a failed check: every service's log, whole, in var/compose-logs.txt, and
    its warnings and errors on the console (where CI keeps them)."""
    logs = await stack.compose("logs", "--no-color", "--timestamps")
    path = Path("var") / "compose-logs.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text(logs)  # once, after the failure: blocking the loop here costs nothing
    notable = [line for line in logs.splitlines() if NOTABLE.search(line)]
    print(f"the stack's logs are in {path}; their warnings and errors, the last 60:")
    print("\n".join(notable[-60:]))
    if stack.watched:
        print(f"session {stack.watched} in Redis:")
        print(await session_state(stack, stack.watched))
    drops = await stack.compose("exec", "-T", "coordinator", "python", "-c", DROPS)
    print(f"the coordinator's drops: {drops.strip() or 'none'}")


DROPS = """
import urllib.request
body = urllib.request.urlopen("http://127.0.0.1:8080/metrics", timeout=5).read().decode()
print(" ".join(l for l in body.splitlines() if l.startswith("duplexq_dropped_stale_total{")))
"""


async def session_state(stack: Stack, session_id: str) -> str:
    """Where a session stands in Redis: its fence and each stage's progress, its leases, the
    length of each of its streams and the newest entries of its client journal."""
    sk = Keys().session(session_id)
    lines = [
        # The fence, each stage's progress and whom to ring for it.
        "meta: " + " ".join((await stack.redis("HGETALL", sk.meta)).split()),
    ]
    for stage in load_pipeline(stack.pipeline).stage_names:
        lease = (await stack.redis("GET", sk.lease(stage))).strip()
        length = (await stack.redis("XLEN", sk.stage_out(stage))).strip()
        lines.append(f"{stage}: lease {lease or '-'}; output stream {length} entries")
    for name, key in (("input", sk.input), ("control", sk.control), ("client", sk.client)):
        lines.append(f"{name}: {(await stack.redis('XLEN', key)).strip()} entries")
    tail = await stack.redis("XREVRANGE", sk.client, "+", "-", "COUNT", "8")
    lines.append("client journal, newest first: " + ascii(tail[-3000:]))
    return "\n".join(lines)


NOTABLE = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Error\b|lost|retry", re.IGNORECASE)


async def drive(stack: Stack, only: set[str]) -> None:
    if "default" in only:
        try:
            await default_pipeline(stack)
        except Failed:
            with contextlib.suppress(Failed):
                await show_logs(stack)
            raise
    if "echo" in only:
        await echo_profile(stack)
    if "cluster" in only:
        try:
            await cluster_profile(stack)
        except Failed:
            logs = await stack.compose("--profile", "echo", "--profile", "cluster", "logs",
                                       "--no-color", "--tail", "40")  # fmt: skip
            print("\n".join(line for line in logs.splitlines() if NOTABLE.search(line))[-6000:])
            raise
    left = (await stack.run(stack.docker, "ps", "-aq")).split()
    if left:
        raise Failed(f"containers left after down: {left}")
    print("down: no container left")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True)
    parser.add_argument("--docker", default="docker")
    parser.add_argument(
        "--rounds", type=int, default=1, help="do the kill and the Redis restart this many times"
    )
    parser.add_argument(
        "--only", default="default,echo,cluster", help="the steps to run: default, echo, cluster"
    )
    args = parser.parse_args()
    stack = Stack(project=args.project, docker=args.docker, port=free_port(), rounds=args.rounds)
    try:
        asyncio.run(drive(stack, set(args.only.split(","))))
    except Failed as exc:
        print(f"compose-test FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        for name, value in stack.figures.items():
            print(f"  {name}: {value}")
    print("compose-test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
