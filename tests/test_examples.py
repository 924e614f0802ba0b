"""The examples run as written, against a served pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn

from tests.browser_helpers import find_chromium
from tests.pipeline_helpers import fast_settings, running_worker
from tests.processes import ROOT
from tests.realtime_helpers import asked_echo, serving
from tests.redis_server import free_port


def _load(name: str):
    return _load_file(name, ROOT / "examples" / f"{name}.py")


def _load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def test_the_sdk_example_gets_its_answer(redis_server, key_prefix, capsys):
    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",))
    pipeline = asked_echo()  # typed text answered when asked, as the shipped echo does
    example = _load("sdk_text_turn")
    async with serving(settings, pipeline) as base, running_worker(settings, pipeline, "echo"):
        answer, status = await example.text_turn(base, "k1", "hello from the example")
    assert (answer, status) == ("hello from the example", "completed")
    assert "hello from the example" in capsys.readouterr().out


@contextlib.asynccontextmanager
async def _served(app: Any) -> AsyncIterator[str]:
    """``app`` served by uvicorn on a free port; yields its http:// base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


async def test_the_browser_example_talks_with_a_client_secret(redis_server, key_prefix):
    from playwright.async_api import async_playwright

    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",))
    pipeline = asked_echo()
    example = _load_file("browser_app", ROOT / "examples" / "browser" / "app.py")
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        _served(example.create_app(base.replace("ws://", "http://"), "k1")) as page_url,
        async_playwright() as playwright,
    ):
        browser = await playwright.chromium.launch(
            executable_path=find_chromium(), args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = await browser.new_page()
            await page.goto(page_url)
            await page.wait_for_function("() => window.exampleState.connected", timeout=15_000)
            await page.fill("#text", "hello from the browser")
            await page.click("button")
            await page.wait_for_function(
                "() => window.exampleState.answers.length > 0", timeout=15_000
            )
            state = await page.evaluate("() => window.exampleState")
            html = await page.content()
        finally:
            await browser.close()
    assert state["answers"] == ["hello from the browser"] and state["errors"] == []
    assert "k1" not in html  # the page only ever held a short-lived secret


async def test_the_function_call_example_runs_the_function_and_gets_the_answer(
    redis_server, key_prefix
):
    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",))
    pipeline = asked_echo()
    example = _load("sdk_function_call")
    async with serving(settings, pipeline) as base, running_worker(settings, pipeline, "echo"):
        # The function runs between these two readings of the clock (a minute may turn
        # in between): its answer is one of them.
        before = example.get_time({})
        calls, answer = await example.call_and_answer(base, "k1", "call:what time is it")
        after = example.get_time({})
    assert calls == ['get_time({"text": "what time is it"})']
    assert answer.endswith(" UTC") and answer in {t[: len(answer)] for t in (before, after)}
