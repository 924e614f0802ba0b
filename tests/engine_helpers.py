"""Scaffolding for the tests that run a real vLLM engine (CPU build) on a tiny model.

A module of such tests starts one engine (``engine_fixture``) on its model
(``model_dir_fixture``) and serves it to every test marked ``engine_test``;
the marks run those tests in the module's event loop, with the engine's
start-up time allowed and the engine's third-party warnings let through.
Importing this module also keeps the engine offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"):
    os.environ.setdefault(_name, "1")

TINY_ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 64 << 20,
    "enforce_eager": True,
    "seed": 0,
    "temperature": 0.0,
}
"""Engine options for a tiny model on CPU: small, eager, greedy and seeded."""


def engine_test_marks(*also_warning: str) -> Callable[[Any], Any]:
    """A decorator for engine tests. vLLM, torch and transformers (and the modules
    named in ``also_warning``) warn about their own internals while vLLM is imported
    and the engine starts; this suite turns warnings into errors, so theirs are let
    through."""
    modules = ("torch.*", "vllm.*", "transformers.*", *also_warning)
    warnings = [
        pytest.mark.filterwarnings(f"ignore::{category}:{module}")
        for category in ("DeprecationWarning", "FutureWarning", "UserWarning")
        for module in modules
    ]
    # The first engine test also starts the engine: half a minute, more on a busy machine.
    marks = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300), *warnings]

    def engine_test(fn: Any) -> Any:
        for mark in marks:
            fn = mark(fn)
        return fn

    return engine_test


def model_dir_fixture(build: Callable[[Path], Path], folder: str) -> Any:
    """A module-scoped ``model_dir`` fixture: the model ``build`` writes into a fresh
    ``folder``. A missing vLLM fails the module's engine tests."""

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory):
        import vllm  # noqa: F401 - scripts/setup installs it

        return str(build(tmp_path_factory.mktemp(folder)))

    return model_dir


class Recorder:
    """Wraps ``AsyncLLM.generate``: keeps each request's prompt and last output."""

    def __init__(self, llm: Any) -> None:
        self.requests: dict[str, tuple[dict[str, Any], object]] = {}
        self._generate = llm.generate

    async def generate(self, prompt, params, request_id, *args, **kwargs):
        self.requests[request_id] = (prompt, None)
        async for output in self._generate(prompt, params, request_id, *args, **kwargs):
            # Kept as it comes: the stage may close the stream after any step.
            self.requests[request_id] = (prompt, output)
            yield output


def engine_fixture(make: Callable[[str], Any], *, record: bool = False) -> Any:
    """A module-scoped ``engine`` fixture: ``make(model_dir)``, started, shut down after
    the module. With ``record``, ``engine.recorder`` (a ``Recorder``) sees every call
    of the engine's ``AsyncLLM.generate`` without changing it."""

    @pytest_asyncio.fixture(scope="module", loop_scope="module")
    async def engine(model_dir):
        engine = make(model_dir)
        started = time.monotonic()
        llm = await engine.ready()
        print(f"\nvLLM engine started in {time.monotonic() - started:.1f} s")
        if record:
            engine.recorder = Recorder(llm)
            llm.generate = engine.recorder.generate  # the instance's generate: recorded, unchanged
        yield engine
        await engine.shutdown()

    return engine


class Hold:
    """Freezes the engine once ``requests`` requests have each produced ``tokens`` tokens.

    vLLM's pause in "keep" mode stops every request where it stands, still tracked
    and abortable. A test that acts on a request "mid-generation" holds the engine
    first: however slowly the rest of the pipeline runs, the request cannot finish
    before the test has acted on it.
    """

    def __init__(self, llm: Any, tokens: int, requests: int) -> None:
        self.llm = llm
        self.tokens = tokens
        self.requests = requests
        self.held = asyncio.Event()
        """Set once the engine has paused."""
        self._produced: dict[str, int] = {}
        self._pausing: asyncio.Task[None] | None = None

    def wrap(self, generate: Any) -> Any:
        async def held_generate(prompt, params, request_id, *args, **kwargs):
            async for output in generate(prompt, params, request_id, *args, **kwargs):
                # The stages stream deltas: each output carries its new tokens only.
                produced = self._produced.get(request_id, 0) + len(output.outputs[0].token_ids)
                self._produced[request_id] = produced
                enough = sum(n >= self.tokens for n in self._produced.values())
                if self._pausing is None and enough >= self.requests:
                    self._pausing = asyncio.get_running_loop().create_task(self._pause())
                yield output

        return held_generate

    async def _pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        self.held.set()

    async def wait(self, timeout: float = 60.0) -> None:
        """Until the engine has paused."""
        async with asyncio.timeout(timeout):
            await self.held.wait()


@contextlib.asynccontextmanager
async def held_after(engine: Any, tokens: int, requests: int = 1) -> AsyncIterator[Hold]:
    """Within the block, the engine pauses once ``requests`` requests have each
    produced ``tokens`` tokens (see ``Hold``); it resumes when the block ends."""
    llm = await engine.ready()
    hold = Hold(llm, tokens, requests)
    own = vars(llm).get("generate")  # a recorder's wrapper, or None: the class's method
    llm.generate = hold.wrap(llm.generate)
    try:
        yield hold
    finally:
        if own is None:
            del llm.generate
        else:
            llm.generate = own
        if hold._pausing is not None:
            await hold._pausing
            await llm.resume_generation()


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until ``check()`` holds; fails after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def greedy_steps(engine: Any, prompt: str, max_tokens: int) -> AsyncIterator[Any]:
    """The steps the engine produces, uninterrupted and greedily, for ``prompt``."""
    from workers.backends.vllm_engine import SamplingSpec

    spec = SamplingSpec(max_tokens, 0.0, 1.0, 0)
    async for step in engine.generate(engine.encode(prompt), spec, f"ref-{time.time_ns()}"):
        yield step
