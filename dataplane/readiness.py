"""Which stages are ready to serve, and which model each worker serves.

A worker loads its stage's model before it takes any session
(``workers.runtime``). Only then does it record what it serves in the stage's
model hash (``Keys.stage_models``: worker id -> ``StageModel`` JSON) and start
heartbeating into the stage's worker set (``Keys.workers``). So a worker with a
fresh heartbeat is a worker whose model is loaded, and everything that asks
whether a stage is ready reads it here or from that set: ``/readyz``, the
compose healthchecks, ``duplexq up`` ("stage X: ready") and the demo page
(``/v1/stages``), which also learns from it that a stage serves the
random-weight fallback model.

A worker that stops removes both entries; one killed leaves them behind, and
its heartbeat goes stale: readers count only workers heard from within
``fresh_ms``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import cast

from dataplane.bus import RedisBus
from schemas.keys import worker_bell


@dataclass(frozen=True, slots=True)
class StageModel:
    """What one worker serves, once loaded."""

    model: str = ""
    """The model as the stage's options name it ("" for a stage without a model)."""
    fallback: bool = False
    """The configured model was not available: the worker serves the tiny
    random-weight model instead (``workers.backends.model_source``)."""
    load_s: float = 0.0
    """Seconds the worker took to load it."""

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "fallback": self.fallback, "load_s": self.load_s})

    @classmethod
    def from_json(cls, raw: str) -> StageModel:
        """The record a worker wrote; an unreadable one reads as a stage without a model."""
        try:
            data = json.loads(raw)
            return cls(str(data["model"]), data["fallback"] is True, float(data["load_s"]))
        except (ValueError, TypeError, KeyError):
            return cls()


@dataclass(frozen=True, slots=True)
class StageReadiness:
    """One stage's live workers (model loaded, heartbeat fresh) and what they serve."""

    stage: str
    models: dict[str, StageModel] = field(default_factory=dict)
    """By worker id, for every live worker."""

    @property
    def ready(self) -> bool:
        return bool(self.models)

    @property
    def fallback(self) -> bool:
        return any(model.fallback for model in self.models.values())

    def public(self) -> dict[str, object]:
        """What a client may see (``/v1/stages``): no worker ids, no host names."""
        distinct = sorted({(m.model, m.fallback) for m in self.models.values()})
        return {
            "name": self.stage,
            "ready": self.ready,
            "workers": len(self.models),
            "models": [{"model": model, "fallback": fallback} for model, fallback in distinct],
        }


async def announce(bus: RedisBus, stage: str, worker_id: str, model: StageModel) -> None:
    """Record what ``worker_id`` serves (before its first heartbeat)."""
    await bus.hset(bus.keys.stage_models(stage), {worker_id: model.to_json()})


async def withdraw(bus: RedisBus, stage: str, worker_id: str) -> None:
    """Remove ``worker_id`` from its stage's live workers and models, and delete its bells
    (it stops)."""
    await bus.client.zrem(bus.keys.workers(stage), worker_id)
    await cast(Awaitable[int], bus.client.hdel(bus.keys.stage_models(stage), worker_id))
    await bus.client.delete(*bus.keys.bells(worker_bell(stage, worker_id)))


async def read_stage(bus: RedisBus, stage: str, fresh_ms: int) -> StageReadiness:
    """``stage``'s workers heard from within ``fresh_ms`` and what each serves."""
    oldest = time.time() * 1000 - fresh_ms
    live = await bus.client.zrangebyscore(bus.keys.workers(stage), oldest, "+inf")
    records = await bus.hgetall(bus.keys.stage_models(stage))
    models = {}
    for raw in live:
        worker = raw.decode() if isinstance(raw, bytes) else str(raw)
        record = records.get(worker)
        models[worker] = StageModel.from_json(record) if record else StageModel()
    return StageReadiness(stage, models)


async def read_stages(bus: RedisBus, stages: list[str], fresh_ms: int) -> list[StageReadiness]:
    """``read_stage`` for each of ``stages``, in order."""
    return [await read_stage(bus, stage, fresh_ms) for stage in stages]
