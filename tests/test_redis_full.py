"""A full Redis (maxmemory, noeviction) refuses writes: clients hear ``redis_full`` for the
events it refused, nobody is disconnected, no session fails over, nothing accepted is
lost, and everything goes on by itself once Redis has room (``dataplane.full``)."""

import asyncio
import base64
import contextlib
import logging
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from coordinator.attachments import Attachments
from coordinator.response_requests import REQUESTED
from coordinator.service import Coordinator
from dataplane.authority import SessionAuthority
from dataplane.bus import RedisBus
from dataplane.multi import multi_script
from dataplane.scripts import ALLOW_OOM
from schemas.config import Settings, echo_pipeline
from schemas.errors import ErrorCode, RedisFullError
from schemas.events import TextPayload
from schemas.keys import Keys
from tests.pipeline_helpers import fast_settings, running_worker
from tests.processes import WorkerProcess, write_pipeline
from tests.realtime_helpers import Client, asked_echo, serving, text_turn, until_completed
from tests.redis_server import RedisServer
from workers.ownership import StageOwnership

# -- the adapter ---------------------------------------------------------------------------


@contextlib.contextmanager
def refusing_writes(ports: list[int]):
    """Every node at a limit far below what it holds (so every write that adds is
    refused), then back to no limit."""
    clients = [redis.Redis(port=port) for port in ports]
    try:
        for client in clients:
            client.config_set("maxmemory", 1)
        yield
    finally:
        for client in clients:
            client.config_set("maxmemory", 0)
            client.close()


@pytest.fixture(params=["redis", "cluster"])
def target(request):
    """(URL, every node's port) of a real single Redis, then of a real Redis Cluster."""
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return cluster.url, [node.port for node in cluster.nodes]
    server = request.getfixturevalue("redis_server")
    return server.url, [server.port]


async def test_a_refused_write_is_a_redis_full_error_and_writes_nothing(target, key_prefix):
    url, ports = target
    pipeline = echo_pipeline("echo")
    bus = RedisBus(url, Keys(key_prefix))
    authority = SessionAuthority(bus, pipeline)
    try:
        await authority.open("s1")
        await authority.open("s2")
        log = bus.keys.session("s1").input
        with refusing_writes(ports):
            with pytest.raises(RedisFullError) as refused:
                await authority.append("s1", "append_text", TextPayload("a"))
            assert refused.value.code is ErrorCode.REDIS_FULL and refused.value.retryable
            # Calls made together share one script call on a single Redis (its multi
            # form): each is refused on its own.
            both = await asyncio.gather(
                authority.append("s1", "append_text", TextPayload("b")),
                authority.append("s2", "append_text", TextPayload("c")),
                return_exceptions=True,
            )
            assert [type(r) for r in both] == [RedisFullError, RedisFullError]
            with pytest.raises(RedisFullError):  # a plain command as well
                await bus.hset(bus.keys.session("s1").meta, {"config": "{}"})
            assert await bus.xlen(log) == 0
        receipt = await authority.append("s1", "append_text", TextPayload("d"))
        assert receipt.seq == 1 and await bus.xlen(log) == 1  # the refused ones left nothing
    finally:
        await bus.aclose()


async def test_renewals_and_holds_run_on_a_full_redis(target, key_prefix):
    url, ports = target
    pipeline = echo_pipeline("echo")
    bus = RedisBus(url, Keys(key_prefix))
    authority = SessionAuthority(bus, pipeline)
    ownership = StageOwnership(bus, pipeline, "echo", "w1", ttl_ms=3000)
    attachments = Attachments(bus, ttl_ms=5000)
    sessions = ["s1", "s2"]
    try:
        leases = []
        for sid in sessions:
            await authority.open(sid)
            leases.append((await ownership.acquire(sid, 1000))[1])
            await attachments.attach(sid, f"att-{sid}", "", 1000, resume=False)
        workers = bus.keys.workers("echo")
        await bus.rescore(workers, {"w1": 1})  # not there yet: added by a plain ZADD
        lease_keys = [bus.keys.session(sid).lease("echo") for sid in sessions]
        for key in lease_keys:
            await bus.client.pexpire(key, 1500)
        with refusing_writes(ports):
            # Renewed together, as a heartbeat renews (one multi script on a single Redis).
            assert await ownership.renew(leases, 2000) == [True, True]
            for key in lease_keys:
                assert await bus.client.pttl(key) > 2000
            holds = await attachments.hold({sid: f"att-{sid}" for sid in sessions}, 9000)
            assert holds == {"s1": "ok", "s2": "ok"}
            for sid in sessions:
                meta = bus.keys.session(sid).meta
                assert await bus.hmget(meta, ["att_until"]) == [b"14000"]
            assert await attachments.detach("s1", "att-s1", 9500)  # the grace starts now
            assert await bus.hmget(bus.keys.session("s1").meta, ["att_until"]) == [b"9500"]
            await bus.rescore(workers, {"w1": 2})  # a member's new score: taken
            assert await bus.client.zscore(workers, "w1") == 2
            with pytest.raises(RedisFullError):  # a new member: refused
                await bus.rescore(workers, {"w2": 2})
            lease_index = bus.keys.lease_index("echo")
            assert await bus.client.zscore(lease_index, "s1") == 2000 + 3000
    finally:
        await bus.aclose()


async def test_a_requested_responses_commit_lands_on_a_redis_that_fills_after_its_notice(
    target, key_prefix
):
    """A ``response.create`` reserves its response, journals the notice that it was asked
    for (the client hears ``response.created``), then appends the turn's commit. Redis
    filling up between the notice and the commit left a response the client was told of
    with no commit asking for it: never answered, never done. The commit that follows
    such a notice runs on a full Redis too, as the notice does: one commit per response
    reserved, and the reservation is refused on a full Redis."""
    url, ports = target
    coordinator = Coordinator(fast_settings(url, key_prefix), echo_pipeline("echo"))
    keys = coordinator.bus.keys.session("s1")
    filling = contextlib.ExitStack()

    def notice(fence):
        filling.enter_context(refusing_writes(ports))  # Redis is full from here on
        return {"type": REQUESTED, "response_id": f"resp_{fence.response_seq}"}

    try:
        await coordinator.open("s1")
        with filling:
            commit = await coordinator.commit("s1", notice=notice)
            assert commit.receipt.seq == 1 and commit.fence.response_seq == 1
            with pytest.raises(RedisFullError):  # anything else is refused still
                await coordinator.append("s1", "append_text", TextPayload("a"))
            with pytest.raises(RedisFullError):  # and so is the next reservation
                await coordinator.commit("s1", notice=lambda fence: None)
        assert await coordinator.bus.xlen(keys.input) == 1
        journal = await coordinator.journal_page("s1", "", 10)
        assert [b"requested" in e.fields[b"e"] for e in journal] == [True]
    finally:
        await coordinator.aclose()


def test_the_multi_form_keeps_a_scripts_flags_first():
    """Redis reads a script's flags on its first line only (elsewhere the line does not
    compile): the multi form of a flagged script starts with them too."""
    bus = RedisBus("redis://127.0.0.1:1/0")  # not connected: only the scripts' texts
    for script in (bus.renew_script, bus.hold_script, bus.detach_script, bus.rescore_script):
        assert script.script.startswith(ALLOW_OOM)
        assert multi_script(script.script).script.startswith(ALLOW_OOM)
    assert not multi_script(bus.append_script.script).script.startswith("#!")


# -- end to end ----------------------------------------------------------------------------

MB = 1024 * 1024
FILLER = [f"filler:{n}" for n in range(16)]
"""Keys of 512 KB each that take Redis over its limit; deleting them makes room again."""


async def store_filler(client: aioredis.Redis) -> None:
    """Store 8 MB while Redis has no limit (a write is refused once Redis is over its
    limit, and a large one's own buffer counts towards it)."""
    for key in FILLER:
        await client.set(key, b"x" * (MB // 2))


async def refuse_writes(client: aioredis.Redis) -> None:
    """Set ``maxmemory`` 4 MB below what Redis holds, the filler included: Redis is far
    more over its limit than its own buffers ever move, and refuses every write that
    adds data."""
    used = int((await client.info("memory"))["used_memory"])
    await client.config_set("maxmemory", used - 4 * MB)
    with pytest.raises(redis.OutOfMemoryError):
        await client.set("probe", "1")


async def free(client: aioredis.Redis) -> None:
    """Delete the filler (a delete runs on a full Redis): 4 MB below the limit again."""
    await client.delete(*FILLER)
    await client.set("probe", "1")


SILENCE = base64.b64encode(b"\x00\x00" * 480).decode()
"""20 ms of 24 kHz PCM16 silence."""

REFUSED = [
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "refused"}]}},
    {"type": "input_audio_buffer.append", "audio": SILENCE},
    {"type": "input_audio_buffer.commit"},
    {"type": "input_audio_buffer.clear"},
    {"type": "session.update", "session": {"instructions": "be brief"}},
    {"type": "response.cancel"},  # the accepted turn's response is still in progress
    {"type": "duplexq.barge_in"},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "system",
     "content": [{"type": "input_text", "text": "context"}]}},
]  # fmt: skip
"""A client event of each path to Redis: every one needs a write a full Redis refuses."""


def _deltas(events):
    return "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")


def _texts(response: dict) -> list[str]:
    """The text parts of a response's output."""
    parts = [part for item in response["output"] for part in item.get("content", [])]
    return [part["text"] for part in parts if part.get("type") == "output_text"]


async def _refused(client: Client, events: list[dict], tag: str) -> None:
    """Send ``events`` (with event ids): each is answered by a ``redis_full`` error naming
    it, in order, and by nothing else."""
    ids = [f"{tag}-{n}" for n in range(len(events))]
    for event_id, event in zip(ids, events, strict=True):
        await client.send({**event, "event_id": event_id})
    answers = [await client.recv() for _ in events]
    assert [(a["type"], a["error"]["code"], a["error"]["event_id"]) for a in answers] == [
        ("error", "redis_full", event_id) for event_id in ids
    ]


async def test_a_full_redis_drops_no_client_and_fails_no_session_over(tmp_path: Path, caplog):
    server = RedisServer(tmp_path / "redis")  # the shipped persistence (AOF, fsync always)
    server.start()
    # The shipped lease and heartbeat: Redis stays full for twice the lease's TTL.
    ttl_ms = Settings.model_fields["lease_ttl_ms"].default
    heartbeat_ms = Settings.model_fields["heartbeat_ms"].default
    settings = fast_settings(
        server.url, "full", lease_ttl_ms=ttl_ms, heartbeat_ms=heartbeat_ms,
        api_keys=("k1",), first_event_wait_ms=50,
    )  # fmt: skip
    pipeline = asked_echo()  # a typed turn's answer is its response (echo answers audio at once)
    path = write_pipeline(tmp_path, pipeline)
    # w0 serves the session; w1 starts while Redis is full, and could take the session
    # over if its lease lapsed.
    procs = [WorkerProcess(settings, path, "echo", f"w{i}", tmp_path) for i in range(2)]
    procs[0].start()
    direct = aioredis.Redis.from_url(server.url)
    uvicorn_log = logging.getLogger("uvicorn")  # it does not propagate to the root logger
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    try:
        async with serving(settings, pipeline) as base, Client.connect(base) as client:
            created = await client.recv()
            assert created["duplexq"]["fence"]["incarnation"] == 0
            sk = Keys("full").session(created["session"]["id"])
            for event in text_turn("one"):
                await client.send(event)
            assert _deltas(await until_completed(client, 30)) == "one"
            lease = await direct.get(sk.lease("echo"))
            assert lease is not None
            await store_filler(direct)

            # A turn is accepted while its worker is stopped (for a few milliseconds, well
            # within the lease), so its answer is published only once Redis is full.
            procs[0].signal(signal.SIGSTOP)
            for event in text_turn("two"):
                await client.send(event)
            await client.until("conversation.item.done")  # created, added, done
            await client.until("response.created")  # its response.create was taken
            # Audio taken before Redis fills: the commit refused below has input to commit
            # (with none, it would be refused as empty before any write).
            await client.send({"type": "input_audio_buffer.append", "audio": SILENCE})
            async with asyncio.timeout(10):
                while await direct.xlen(sk.input) < 5:  # the text, its commit, the audio
                    await asyncio.sleep(0.01)
            await refuse_writes(direct)
            procs[0].signal(signal.SIGCONT)
            procs[1].start()
            full_since = time.monotonic()
            held_until = int((await direct.hget(sk.meta, "att_until")) or 0)

            await _refused(client, REFUSED, "a")
            # Longer than the lease's TTL: the lease is renewed and stays with its worker.
            while time.monotonic() - full_since < 2 * ttl_ms / 1000:
                assert await direct.get(sk.lease("echo")) == lease
                assert await direct.hget(sk.meta, "inc") == b"0"
                await asyncio.sleep(0.25)
            assert int(await direct.hget(sk.meta, "att_until")) > held_until  # held too
            await _refused(client, REFUSED[:1], "b")  # the same socket, still served
            # A new session cannot be opened, nor a client secret minted: refused with
            # the same code (the socket closes with 1013, try again later).
            async with Client.connect(base) as late:
                refused = await late.recv()
                assert (refused["type"], refused["error"]["code"]) == ("error", "redis_full")
                await late.ws.wait_closed()
                assert late.ws.close_code == 1013
            async with httpx.AsyncClient() as http:
                minted = await http.post(
                    base.replace("ws://", "http://", 1) + "/v1/realtime/client_secrets",
                    headers={"Authorization": "Bearer k1"},
                )
            assert minted.status_code == 503
            assert minted.json()["error"]["code"] == "redis_full"
            with pytest.raises(redis.OutOfMemoryError):
                await direct.set("probe", "1")

            await free(direct)
            # The turn accepted before Redis filled up is answered, once; the next too.
            assert _deltas(await until_completed(client, 30)) == "two"
            for event in text_turn("three"):
                await client.send(event)
            assert _deltas(await until_completed(client, 30)) == "three"
            assert client.ws.close_code is None

        seen = client.seen
        assert _deltas(seen) == "onetwothree"
        # Each turn's answer completed. (Echo answers the audio chunk at once, on its own,
        # under the fence of the turn before: a response of its own, without text.)
        done = [e["response"]["status"] for e in seen
                if e["type"] == "response.done" and _texts(e["response"])]  # fmt: skip
        assert done == ["completed"] * 3
        fences = [e["duplexq"]["fence"] for e in seen if "fence" in e.get("duplexq", {})]
        assert fences and all(f["incarnation"] == 0 for f in fences)
        journaled = [e["duplexq"]["seq"] for e in seen if e["type"] != "error"]
        assert journaled == sorted(set(journaled))  # nothing delivered twice
        assert await direct.get(sk.lease("echo")) == lease  # no failover, no new owner
        assert await direct.hget(sk.meta, "inc") == b"0"
        # Three turns and the audio taken before Redis filled; nothing refused was kept.
        assert await direct.xlen(sk.input) == 7
        # The answer to "two" was refused while Redis was full and published after; the
        # worker started meanwhile waited for room and serves now.
        assert "Redis is full: a publish was refused" in procs[0].log()
        async with asyncio.timeout(30):
            while await direct.zscore(Keys("full").workers("echo"), "w1") is None:
                await asyncio.sleep(0.05)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
        for proc in procs:
            assert "Traceback" not in proc.log(), proc.log()[-3000:]
    finally:
        uvicorn_log.removeHandler(caplog.handler)
        for proc in procs:
            proc.terminate()
        await direct.aclose()
        server.stop()


async def test_an_input_that_takes_redis_over_its_limit_is_acknowledged(tmp_path: Path):
    """Redis checks its limit before a write, not after: the write that takes it over is
    taken. Its acknowledgement (``conversation.item.created``) must not then be refused,
    or the client, told ``redis_full``, sends again an input Redis took, and hears its
    answer twice (the nemesis found it: ``docs/nemesis.md``). A 200 KB input meets a limit
    just above what Redis holds, raised 64 KB at a time while the input itself is refused
    (the command's own buffer counts towards the limit): the first limit it fits under
    is one its append takes Redis over, and the notice after it finds Redis full."""
    server = RedisServer(tmp_path / "redis")  # its own: its limit is changed
    server.start()
    settings = fast_settings(server.url, "over", api_keys=("k1",))
    pipeline = echo_pipeline("echo")
    direct = aioredis.Redis.from_url(server.url)
    parts = [f"{n}" * 25_000 for n in range(8)]  # a content part holds at most 32 KB
    text = "".join(parts)
    item = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": part} for part in parts]}  # fmt: skip
    try:
        async with (
            running_worker(settings, pipeline, "echo"),
            serving(settings, pipeline) as base,
            Client.connect(base) as client,
        ):
            sid = (await client.recv())["session"]["id"]
            log = Keys("over").session(sid).input
            for event in text_turn("one"):
                await client.send(event)
            assert _deltas(await until_completed(client, 30)) == "one"
            for margin in range(64_000, 2_000_000, 64_000):
                used = int((await direct.info("memory"))["used_memory"])
                await direct.config_set("maxmemory", used + margin)
                try:
                    await client.send({"type": "conversation.item.create",
                                       "event_id": f"big-{margin}", "item": item})  # fmt: skip
                    answer = await client.recv()
                    if await direct.xlen(log) == 2:  # refused, nothing taken: a higher limit
                        assert answer["error"]["code"] == "redis_full", answer
                        continue
                    assert answer["type"] == "conversation.item.created", answer
                    with pytest.raises(redis.OutOfMemoryError):  # it was over its limit
                        await direct.set("probe", "1")
                    break
                finally:
                    await direct.config_set("maxmemory", 0)
            else:
                raise AssertionError("the input was refused under every limit tried")
            await client.send({"type": "response.create"})
            assert _deltas(await until_completed(client, 30)) == text  # once
            assert await direct.xlen(log) == 4  # one's text and commit, the big one's
    finally:
        await direct.aclose()
        server.stop()
