"""Real speech for the speech-stage tests, made on the spot with espeak-ng.

Nothing is downloaded: espeak-ng (a system package that scripts/setup installs,
like redis-server) synthesizes the words and the audio is converted with the
stages' own PCM helpers.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

import numpy as np

from schemas.events import AudioPayload
from workers.backends.audio import WavStream, encode_pcm, resample

RATE = 16_000


@functools.cache
def _spoken(text: str, rate: int) -> bytes:
    binary = shutil.which("espeak-ng")
    if binary is None:
        raise RuntimeError("espeak-ng is not installed; run scripts/setup")
    wav = subprocess.run(
        [binary, "--stdout", "--stdin"], input=text.encode(), capture_output=True, check=True
    ).stdout
    reader = WavStream()
    samples = reader.feed(wav)
    assert reader.sample_rate is not None
    return resample(samples, reader.sample_rate, rate).astype("<f4").tobytes()


def speak(text: str, rate: int = RATE) -> np.ndarray:
    """``text`` spoken by espeak-ng: mono float32 samples at ``rate`` (16 kHz by default)."""
    return np.frombuffer(_spoken(text, rate), dtype="<f4").astype(np.float32)


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(round(seconds * rate), dtype=np.float32)


def chunks(
    samples: np.ndarray, *, ms: int = 40, rate: int = RATE, fmt: str = "pcm_f32le"
) -> list[AudioPayload]:
    """``samples`` cut into ``ms`` chunks, as a client streams them."""
    step = rate * ms // 1000
    return [
        AudioPayload(encode_pcm(samples[i : i + step], fmt), fmt, rate)
        for i in range(0, len(samples), step)
    ]
