"""A Redis restart (AOF, fsync always) under load: sessions go on, nothing acknowledged is lost."""

import asyncio

from coordinator.service import Coordinator
from schemas.config import echo_pipeline
from schemas.events import TextPayload
from tests.pipeline_helpers import fast_settings, outputs_of
from tests.processes import WorkerProcess, write_pipeline
from tests.redis_server import RedisServer


async def test_redis_restart_under_load(tmp_path):
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    settings = fast_settings(server.url, "rr", lease_ttl_ms=3000, heartbeat_ms=300)
    pipeline = echo_pipeline("echo")
    path = write_pipeline(tmp_path, pipeline)
    procs = [WorkerProcess(settings, path, "echo", f"w{i}", tmp_path).start() for i in range(2)]
    coordinator = Coordinator(settings, pipeline)
    sessions = ["a", "b", "c"]
    acknowledged: dict[str, list[str]] = {sid: [] for sid in sessions}
    try:
        for sid in sessions:
            await coordinator.open(sid)

        async def load(sid: str) -> None:
            for n in range(60):
                text = f"{sid}{n}"
                await coordinator.append(sid, "append_text", TextPayload(text))
                acknowledged[sid].append(text)
                await asyncio.sleep(0.01)

        writers = asyncio.gather(*(load(sid) for sid in sessions))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(server.restart)
        await writers

        delivered: dict[str, list[str]] = {sid: [] for sid in sessions}
        async with asyncio.timeout(60):
            while any(not set(acknowledged[sid]) <= set(delivered[sid]) for sid in sessions):
                for output in outputs_of(await coordinator.outputs(block_ms=100)):
                    delivered[output.fence.session_id].append(output.text)
        # Anything delivered twice would arrive within a few more reads.
        for _ in range(5):
            for output in outputs_of(await coordinator.outputs(block_ms=100)):
                delivered[output.fence.session_id].append(output.text)
        for sid in sessions:
            # Writes retried across the restart are recognised as repeats: every
            # acknowledged input is in the log once and answered once, in order.
            assert delivered[sid] == acknowledged[sid]
            log = await coordinator.bus.xrange(coordinator.bus.keys.session(sid).input)
            assert len(log) == len(acknowledged[sid])
    finally:
        await coordinator.aclose()
        for proc in procs:
            proc.terminate()
        server.stop()
