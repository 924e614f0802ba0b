"""A stage worker process whose backend reports when its work for an epoch stops.

``python -m bench.traced_worker --stage S --pipeline P --worker-id W --trace FILE``
runs the product's ``Worker`` exactly as ``python -m workers`` does, with the
stage's own backend (echo or vLLM, built by the registry from the pipeline
config) wrapped in ``TracedBackend``. The wrapper changes nothing the
backend does; it appends one JSON line to ``FILE`` when

- ``handle`` ends for an event (finished, or cancelled by a barge-in), with
  the epoch it was serving and how many drafts it produced, and
- ``release`` is called for a fence and when it returned (for vLLM: the
  request has been aborted in the engine by then),

stamped with ``time.monotonic_ns()``, the clock the benchmark process also
reads. That is how the barge-in benchmark times "the worker stopped working
for the old epoch" from another process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from dataplane.config import load_pipeline_for, load_settings
from schemas.events import OutputEvent
from schemas.fence import Fence
from workers.backends import StageBackend, StageContext, create_backend
from workers.backends.base import OutputDraft, StageEvent
from workers.runtime import Worker


class TracedBackend:
    """Delegates to ``inner`` and writes when handling stops and releases end."""

    def __init__(self, inner: StageBackend, trace: Path) -> None:
        self.inner = inner
        self.name = inner.name
        self.continuous_input = inner.continuous_input
        self.follows_responses = getattr(inner, "follows_responses", True)
        self.rebuild = inner.rebuild
        self.edits_conversation = inner.edits_conversation
        self._trace = trace.open("a", buffering=1)

    def _write(self, **fields: Any) -> None:
        self._trace.write(json.dumps(fields) + "\n")

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        await self.inner.start(ctx, inputs, outputs)
        self._write(ev="start", sid=ctx.session_id, t=time.monotonic_ns())

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        epoch = ctx.fence.epoch
        produced = 0
        outcome = "finished"
        try:
            async for draft in self.inner.handle(ctx, event):
                produced += 1
                yield draft
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._write(ev="handle_end", sid=ctx.session_id, epoch=epoch, seq=event.seq,
                        outcome=outcome, produced=produced, t=time.monotonic_ns())  # fmt: skip

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        await self.inner.absorb(ctx, event)

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        began = time.monotonic_ns()
        await self.inner.release(ctx, fence)
        steps = getattr(self.inner, "steps_after_release", None)
        self._write(ev="release", sid=ctx.session_id, epoch=fence.epoch, t_start=began,
                    t=time.monotonic_ns(), steps_after_release=steps)  # fmt: skip

    async def stop(self, ctx: StageContext) -> None:
        await self.inner.stop(ctx)

    async def aclose(self) -> None:
        await self.inner.aclose()
        self._trace.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.traced_worker")
    parser.add_argument("--stage", required=True)
    parser.add_argument("--pipeline", type=Path, required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level)
    settings = load_settings(None, None)
    pipeline = load_pipeline_for(settings, args.pipeline)
    backend = TracedBackend(create_backend(pipeline.stage(args.stage)), args.trace)
    worker = Worker(settings, pipeline, args.stage, worker_id=args.worker_id, backend=backend)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        await worker.run()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    sys.exit(main())
