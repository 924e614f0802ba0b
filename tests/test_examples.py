"""The examples run as written, against a served pipeline."""

from __future__ import annotations

import importlib.util
import sys

from schemas.config import echo_pipeline
from tests.pipeline_helpers import fast_settings, running_worker
from tests.processes import ROOT
from tests.realtime_helpers import serving


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def test_the_sdk_example_gets_its_answer(redis_server, key_prefix, capsys):
    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",))
    pipeline = echo_pipeline("echo")
    example = _load("sdk_text_turn")
    async with serving(settings, pipeline) as base, running_worker(settings, pipeline, "echo"):
        answer, status = await example.text_turn(base, "k1", "hello from the example")
    assert (answer, status) == ("hello from the example", "completed")
    assert "hello from the example" in capsys.readouterr().out
