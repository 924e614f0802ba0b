"""The voice-agent frameworks people drive a realtime server with, unmodified and with
their default settings, against duplexq as ``duplexq up`` serves it: LiveKit Agents'
OpenAI realtime plugin and Pipecat's OpenAI realtime service, at the versions pinned in
tests/frameworks/requirements.txt (installed by scripts/setup in ``.venv-frameworks``).

Every scenario runs on the default pipeline with the shipped model (VAD, ASR, SmolLM2
on vLLM, TTS): a text turn, an audio turn through the framework's audio input, an
interruption, and a full tool loop. The drivers (tests/frameworks/) run in the
frameworks' venv and print what they saw; these tests judge it.

The tool loop forces the first call (LiveKit: ``generate_reply(tool_choice="required")``;
Pipecat: the session's ``tool_choice``), since the shipped 135M model does not choose a
tool on its own; the call's result and the answer to it are the model's own.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.processes import ROOT
from tests.shipped_stack import API_KEY, START_S, ShippedStack
from tests.speech import speak

FRAMEWORKS_PYTHON = ROOT / ".venv-frameworks" / "bin" / "python"
DRIVERS = ROOT / "tests" / "frameworks"

# The first test waits for the stack to load; each drives a framework through real turns.
pytestmark = pytest.mark.timeout(START_S + 420)


@pytest.fixture
def server(shipped_stack: ShippedStack) -> int:
    """The default pipeline served by ``duplexq up``, one worker per stage."""
    if not FRAMEWORKS_PYTHON.is_file():
        pytest.fail(f"{FRAMEWORKS_PYTHON} is missing: run scripts/setup")
    return shipped_stack.port


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's question, spoken: PCM16 mono at 24 kHz, what both frameworks send."""
    path = tmp_path_factory.mktemp("frameworks-speech") / "question.pcm"
    samples = speak("What is the capital of France?", 24_000)
    (np.clip(samples, -1, 1) * 32767).astype("<i2").tofile(path)
    return path


def drive(framework: str, port: int, scenario: str, *args: str) -> dict[str, Any]:
    base = f"http://127.0.0.1:{port}/v1" if framework == "livekit" else (
        f"ws://127.0.0.1:{port}/v1/realtime"
    )  # fmt: skip
    done = subprocess.run(
        [str(FRAMEWORKS_PYTHON), str(DRIVERS / f"{framework}_driver.py"), base, API_KEY,
         scenario, *args],
        check=False, capture_output=True, text=True, timeout=420, cwd=ROOT,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stdout + done.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1])
    assert "exception" not in result, f"{result}\n{done.stderr[-4000:]}"
    return result


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def said_once(text: str) -> None:
    """An answer that is words, not shown twice (the transcript beside the text)."""
    found = words(text)
    assert len(found) >= 2, text
    half = len(found) // 2
    assert found[:half] != found[half : 2 * half] or half == 0, f"said twice: {text!r}"


# -- LiveKit Agents ------------------------------------------------------------------------


def test_livekit_text_turn(server: int) -> None:
    seen = drive("livekit", server, "text")
    assert seen["errors"] == []
    [text] = seen["texts"]
    said_once(text)
    assert seen["audio_ms"] > 500  # the plugin's default output is audio, with its transcript


def test_livekit_audio_turn(server: int, speech: Path) -> None:
    seen = drive("livekit", server, "audio", str(speech))
    assert seen["errors"] == []
    assert seen["generations"] == 1
    said_once(" ".join(seen["texts"]))
    assert seen["audio_ms"] > 500
    assert "france" in words(" ".join(seen["user_transcripts"]))


def test_livekit_interruption(server: int) -> None:
    seen = drive("livekit", server, "interrupt")
    assert seen["errors"] == []
    assert seen["statuses"][0] == "cancelled"
    assert seen["interrupted_text"]
    said_once(" ".join(seen["after"]["texts"]))


def test_livekit_tool_loop(server: int) -> None:
    seen = drive("livekit", server, "tools")
    assert seen["errors"] == []
    [call] = seen["called"]["calls"]
    assert call["name"] == "get_weather"
    assert isinstance(json.loads(call["arguments"]), dict)
    said_once(" ".join(seen["answer"]["texts"]))


# -- Pipecat -------------------------------------------------------------------------------


def test_pipecat_text_turn(server: int) -> None:
    seen = drive("pipecat", server, "text")
    assert seen["errors"] == []
    [response] = seen["responses"][:1]
    said_once(response["llm_text"])
    assert response["audio_ms"] > 500


def test_pipecat_audio_turn(server: int, speech: Path) -> None:
    seen = drive("pipecat", server, "audio", str(speech))
    assert seen["errors"] == []
    said_once(seen["responses"][0]["llm_text"])
    assert seen["responses"][0]["audio_ms"] > 500


def test_pipecat_interruption_by_voice(server: int, speech: Path) -> None:
    seen = drive("pipecat", server, "interrupt", str(speech))
    assert seen["errors"] == []
    assert seen["interruptions"] >= 1
    cut, answer = seen["responses"][:2]
    assert cut["audio_ms"] < 5000  # the story stopped when the user spoke
    said_once(answer["llm_text"])


def test_pipecat_tool_loop(server: int) -> None:
    seen = drive("pipecat", server, "tools")
    assert seen["errors"] == []
    assert seen["function_results"] == 1
    said_once(" ".join(r["llm_text"] for r in seen["responses"]))
