"""A worker loads its stage's model before it takes sessions, and only then counts as
ready: its heartbeat and its model record in Redis are what ``/readyz``, ``/v1/stages``
(the demo page), compose's healthchecks and ``duplexq up`` read."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from coordinator.service import Coordinator
from dataplane.bus import RedisBus
from dataplane.readiness import StageModel, read_stage
from schemas.config import echo_pipeline
from schemas.events import OutputKind, TextPayload
from schemas.keys import Keys
from tests.pipeline_helpers import fast_settings, read_until, running_worker
from tests.realtime_helpers import serving
from workers.backends.echo import EchoBackend
from workers.loading import ModelLoadFailed
from workers.runtime import Worker, WorkerState

PIPELINE = echo_pipeline("echo")


class LoadingEcho(EchoBackend):
    """Echo with a model to load: ``load`` waits for ``gate``, then says what it serves
    (or fails with ``error``)."""

    def __init__(self, model: StageModel, error: Exception | None = None) -> None:
        super().__init__({})
        self.served = model
        self.error = error
        self.gate = asyncio.Event()
        self.loading = asyncio.Event()

    async def load(self) -> StageModel:
        self.loading.set()
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        return self.served


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",))


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_model_record_reads_back_and_a_bad_one_reads_as_none():
    model = StageModel("package:smollm2-135m-instruct", fallback=True, load_s=31.5)
    assert StageModel.from_json(model.to_json()) == model
    for bad in ("", "{", "[]", '{"model": "m"}', '{"model": "m", "fallback": 1, "load_s": "x"}'):
        assert StageModel.from_json(bad) == StageModel()


async def test_a_worker_is_ready_once_its_model_is_loaded_and_serves_only_then(settings):
    backend = LoadingEcho(StageModel("tiny", fallback=True))
    bus = RedisBus(settings.redis_url, Keys(settings.key_prefix))
    coordinator = Coordinator(settings, PIPELINE)
    try:
        async with (
            serving(settings, PIPELINE) as base,
            running_worker(settings, PIPELINE, "echo", backend=backend) as worker,
        ):
            http = base.replace("ws://", "http://")
            await asyncio.wait_for(backend.loading.wait(), 10)
            # A session opened while the model loads waits for it.
            await coordinator.open("early")
            await coordinator.append("early", "append_text", TextPayload("hello"))
            await coordinator.commit("early")
            await asyncio.sleep(0.5)  # heartbeats and assignment reads would run by now
            assert worker.state is WorkerState.STARTING and not worker.actors
            assert not (await read_stage(bus, "echo", 1000)).ready
            status, body = await asyncio.to_thread(_get, f"{http}/readyz")
            assert status == 503 and body["workers"] == {"echo": 0}
            status, body = await asyncio.to_thread(_get, f"{http}/v1/stages")
            assert status == 200 and body["ready"] is False
            assert body["stages"] == [{"name": "echo", "ready": False, "workers": 0, "models": []}]

            backend.gate.set()
            await read_until(
                coordinator, lambda got: any(d.event.kind is OutputKind.DONE for d in got)
            )
            stage = await read_stage(bus, "echo", 1000)
            assert stage.ready and stage.fallback
            assert stage.models[worker.worker_id].model == "tiny"
            status, body = await asyncio.to_thread(_get, f"{http}/readyz")
            assert status == 200 and body["workers"] == {"echo": 1}
            status, body = await asyncio.to_thread(_get, f"{http}/v1/stages")
            assert body == {
                "ready": True,
                "redis": True,
                "stages": [{"name": "echo", "ready": True, "workers": 1,
                            "models": [{"model": "tiny", "fallback": True}]}],
            }  # fmt: skip
        # Stopped: it is gone from both.
        assert not (await read_stage(bus, "echo", 60_000)).ready
        assert await bus.hgetall(bus.keys.stage_models("echo")) == {}
    finally:
        await coordinator.aclose()
        await bus.aclose()


async def test_a_stop_while_the_model_loads_ends_the_worker_at_once(settings):
    backend = LoadingEcho(StageModel("slow"))  # never finishes loading
    worker = Worker(settings, PIPELINE, "echo", backend=backend)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(backend.loading.wait(), 10)
    started = time.monotonic()
    worker.request_stop()
    await asyncio.wait_for(task, 5)
    assert time.monotonic() - started < 1.0
    assert worker.state is WorkerState.STOPPED and worker.model is None


async def test_a_model_that_cannot_load_ends_the_worker(settings):
    backend = LoadingEcho(StageModel("m"), error=RuntimeError("no weights here"))
    backend.gate.set()
    worker = Worker(settings, PIPELINE, "echo", backend=backend)
    with pytest.raises(ModelLoadFailed, match="stage echo: its model did not load: "
                       "RuntimeError: no weights here"):  # fmt: skip
        await asyncio.wait_for(worker.run(), 10)
    assert worker.state is WorkerState.STOPPED


async def test_up_says_each_stage_ready_and_announces_the_fallback(settings, tmp_path):
    from coordinator.launcher.local_stack import LocalStack

    stack = LocalStack(settings, tmp_path / "pipeline.toml", tmp_path)
    stack.stage_workers = {"echo": ["echo-0"]}  # as start_worker names them
    backend = LoadingEcho(StageModel("package:smollm2", fallback=True))
    lines: list[str] = []
    async with running_worker(settings, PIPELINE, "echo", backend=backend, worker_id="echo-0"):
        waiting = asyncio.create_task(
            stack.wait_ready(["echo"], lambda line, **_: lines.append(line))
        )
        await asyncio.wait_for(backend.loading.wait(), 10)
        await asyncio.sleep(0.5)
        assert lines == [] and not waiting.done()  # loading: not ready yet
        backend.gate.set()
        await asyncio.wait_for(waiting, 10)
    assert lines[0].startswith(
        "stage echo: ready (package:smollm2 (RANDOM-WEIGHT fallback) loaded in "
    )
    assert lines[1].startswith(
        "WARNING: echo-0 serves a tiny RANDOM-WEIGHT model (answers are gibberish)"
    )
    assert "docs/models.md" in lines[1] and len(lines) == 2
    assert stack.fallback_notices() == lines[1:]
