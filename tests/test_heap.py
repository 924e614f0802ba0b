"""A worker process exempts what exists once its model is loaded from garbage
collection (``dataplane.heap``); a worker embedded in another program does not."""

from __future__ import annotations

import asyncio
import gc

from dataplane import heap
from schemas.config import echo_pipeline
from tests.pipeline_helpers import fast_settings
from workers.runtime import Worker


def test_settle_freezes_what_is_alive():
    kept = [object() for _ in range(10)]
    try:
        heap.settle()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()


async def test_a_worker_process_settles_its_heap_once_its_model_is_loaded(redis_server, key_prefix):
    settings = fast_settings(redis_server.url, key_prefix)
    pipeline = echo_pipeline("echo")
    try:
        embedded = Worker(settings, pipeline, "echo", burst=True)
        await asyncio.wait_for(embedded.run(), 30)
        assert gc.get_freeze_count() == 0
        own_process = Worker(settings, pipeline, "echo", burst=True, settle_heap=True)
        await asyncio.wait_for(own_process.run(), 30)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
