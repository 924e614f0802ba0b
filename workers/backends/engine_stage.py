"""What the engine-backed stages share: one engine, its requests' records, releases.

The vLLM chat stage (``vllm_backend``), the MiniCPM-o duplex stage (``minicpmo_stage``)
and the Mage-VL stage (``mage_vl_stage``) each drive one vLLM engine for many sessions.
Their skeleton is the same and lives here once: the engine is made from the stage's
options unless one is given (a test's, shared), and shut down at the end only when
the stage made it; ``load`` starts it (a worker takes no session before its model is
up); every request gets a record, settled with how it ended; and a released fence
aborts whatever of its session the engine still runs for it or an older fence, found
by decoding request ids (``vllm_history.released_by``), since a request can outlive
the stage's own bookkeeping (a failover's rebuild, a task cancelled mid-step).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

from dataplane.readiness import StageModel
from schemas.fence import Fence
from workers.backends.request_log import RequestLog, Tracked
from workers.backends.vllm_engine import VllmEngine
from workers.backends.vllm_history import released_by

log = logging.getLogger("duplexq.worker.engine")

R = TypeVar("R", bound=Tracked)
E = TypeVar("E", bound=VllmEngine)


class EngineStage(Generic[E, R]):
    """The base of a stage over one vLLM engine ``E`` whose requests are recorded as ``R``."""

    def __init__(self, engine: E, *, owns_engine: bool, model: str, records_kept: int) -> None:
        self.engine = engine
        self._owns_engine = owns_engine
        self._model = model
        self._numbers = itertools.count(1)
        """Numbers the stage's requests (a request id's last part)."""
        self.records: RequestLog[R] = RequestLog(records_kept)
        self.released: deque[Fence] = deque(maxlen=records_kept)
        """Fences released lately (newest last)."""

    async def load(self) -> StageModel:
        """Start the engine: the worker takes no session before it is up."""
        await self.engine.ready()
        return StageModel(self._model, fallback=self.engine.fallback)

    async def aclose(self) -> None:
        if self._owns_engine:
            await self.engine.shutdown()

    def next_number(self) -> int:
        return next(self._numbers)

    async def abort(self, request_ids: list[str], outcome: str) -> None:
        """Settle ``request_ids``' records with ``outcome`` and abort them in the engine."""
        self.records.note(request_ids, outcome)
        await self.engine.abort(request_ids)

    async def abort_released(self, session_id: str, fence: Fence, doomed: Iterable[str]) -> None:
        """Abort ``doomed`` (the session's own requests the release ended) and whatever
        else the engine still runs for ``fence``'s session at or before it."""
        ended = list(doomed)
        ended += [rid for rid in self.engine.live_request_ids()
                  if rid not in ended and released_by(rid, fence)]  # fmt: skip
        await self.abort(ended, "released")
        if ended:
            log.debug("session %s: %s released, aborted %s", session_id, fence, ended)
