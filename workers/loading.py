"""A worker's start: its stage's model is loaded before it takes any session.

``load_until_stopped`` runs the backend's ``load`` (``LoadsModel``) unless a stop
comes first; the worker then records what it serves and starts heartbeating
(``dataplane.readiness``), which is what makes it count as ready. A backend
without ``load`` (echo, a test's fake) is ready at once, so tests that start
echo workers pay nothing for it.

A stop during the load returns at once. A load running in a thread cannot be
interrupted: the process's stop grace (``workers.__main__.STOP_GRACE_S``) bounds
how long it can delay the exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import cast

from dataplane.readiness import StageModel
from workers.backends.base import LoadsModel, StageBackend


class ModelLoadFailed(RuntimeError):
    """The stage's model did not load; the message is one line for the operator (the
    cause stays chained, with its traceback)."""


async def load_model(backend: StageBackend) -> StageModel:
    """Load ``backend``'s model and say what it serves, with the time it took."""
    load = getattr(backend, "load", None)
    if load is None:
        return StageModel()
    started = time.monotonic()
    model = await cast(LoadsModel, backend).load()
    return dataclasses.replace(model, load_s=round(time.monotonic() - started, 2))


async def load_until_stopped(backend: StageBackend, stopping: asyncio.Event) -> StageModel | None:
    """``load_model``, or None as soon as ``stopping`` is set; a load that fails raises."""
    if getattr(backend, "load", None) is None:
        return StageModel()
    loading = asyncio.ensure_future(load_model(backend))
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((loading, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not loading.done():
            loading.cancel()
            await asyncio.wait((loading,))  # returns at once: only its waiting is cut
    if loading.cancelled():
        return None
    return loading.result()
