"""Driving the browser demo in headless Chromium with a fake microphone and camera.

Chromium is Debian's (``/usr/bin/chromium``, installed by scripts/setup) and
is driven through Playwright's Python client; Playwright's own browser
downloads are never used. The fake microphone plays a WAV file (in a loop)
that espeak-ng speaks on the spot; the fake camera is Chromium's test pattern.

The page keeps its state in ``window.duplexqDemo``; tests wait on it with
``wait_for`` (a JS predicate over ``s``, the state), never on fixed sleeps.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from tests.speech import silence, speak

CHROMIUM = "/usr/bin/chromium"
WAV_RATE = 48_000
"""Rate of the fake microphone's file (Chromium's capture rate)."""


def find_chromium() -> str:
    """The Chromium executable; a missing one fails the test (CI installs it)."""
    path = shutil.which(CHROMIUM)
    if path is None:
        raise RuntimeError(
            f"Chromium not found at {CHROMIUM!r}: apt-get install chromium (scripts/setup does)"
        )
    return path


def write_speech_wav(path: Path, text: str, *, lead_s: float, tail_s: float) -> float:
    """``lead_s`` of silence, ``text`` spoken by espeak-ng, ``tail_s`` of silence, as a
    48 kHz 16-bit mono WAV for ``--use-file-for-fake-audio-capture``; returns the length
    of the spoken part in seconds."""
    spoken = speak(text, WAV_RATE)
    samples = np.concatenate([silence(lead_s, WAV_RATE), spoken, silence(tail_s, WAV_RATE)])
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(WAV_RATE)
        out.writeframes(pcm)
    return len(spoken) / WAV_RATE


def write_tone_wav(path: Path, seconds: float = 1.0, hz: float = 440.0) -> None:
    """A steady tone for pipelines that only echo the microphone."""
    t = np.arange(round(seconds * WAV_RATE)) / WAV_RATE
    pcm = (0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2").tobytes()
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(WAV_RATE)
        out.writeframes(pcm)


def chromium_args(mic_wav: Path) -> list[str]:
    return [
        "--no-sandbox",  # the tests run as root in containers
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic_wav}",
        "--autoplay-policy=no-user-gesture-required",
        "--disable-gpu",
    ]


class DemoPage:
    """The demo page in a headless Chromium tab, observed through ``window.duplexqDemo``."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.console: list[str] = []
        page.on("console", lambda message: self.console.append(message.text))
        page.on("pageerror", lambda error: self.console.append(f"pageerror: {error}"))

    async def state(self) -> dict[str, Any]:
        """A JSON copy of the page's state."""
        raw = await self.page.evaluate("() => JSON.stringify(window.duplexqDemo)")
        return json.loads(raw)  # type: ignore[no-any-return]

    async def evaluate(self, script: str) -> Any:
        return await self.page.evaluate(script)

    async def wait_for(self, predicate: str, timeout_s: float = 20.0) -> dict[str, Any]:
        """Wait until ``predicate`` (JS over the state ``s``) holds; returns the state.

        On timeout the assertion message carries the state and the console, which is
        what one needs to see why the page did not get there.
        """
        from playwright.async_api import TimeoutError as PlaywrightTimeout

        script = f"() => {{ const s = window.duplexqDemo; return !!(s && ({predicate})); }}"
        try:
            await self.page.wait_for_function(script, timeout=timeout_s * 1000, polling=20)
        except PlaywrightTimeout:
            snapshot = await self.state()
            snapshot["events"] = snapshot.get("events", [])[-80:]
            raise AssertionError(
                f"page never reached {predicate!r} within {timeout_s}s\n"
                f"state: {json.dumps(snapshot, indent=1)[:8000]}\n"
                f"console: {self.console[-30:]}"
            ) from None
        return await self.state()

    async def connect_and_speak_once(self) -> None:
        """Connect, wait until the looping microphone's first utterance ends, then mute
        it (it sends silence) so it speaks again only when a test unmutes it."""
        await self.page.click("#connect")
        await self.wait_for("(s.eventCounts['input_audio_buffer.speech_stopped'] || 0) > 0")
        await self.page.check("#mute")


@contextlib.asynccontextmanager
async def demo_page(http_base: str, mic_wav: Path, api_key: str = "k1") -> AsyncIterator[DemoPage]:
    """Headless Chromium on the coordinator's demo page, not yet connected."""
    from playwright.async_api import async_playwright

    executable = find_chromium()
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=executable, args=chromium_args(mic_wav), headless=True
        )
        try:
            demo = DemoPage(await browser.new_page())
            await demo.page.goto(f"{http_base}/")
            await demo.page.wait_for_function("() => window.duplexqDemo !== undefined")
            # The page mints a client secret with the key typed in: no key in its URL.
            await demo.page.fill("#api-key", api_key)
            yield demo
        finally:
            await browser.close()
