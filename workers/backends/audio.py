"""PCM helpers shared by the speech stages (pure: numpy only, no I/O, no asyncio).

Audio crosses the streams as raw little-endian PCM bytes named by a format
(``pcm_f32le`` or ``pcm_s16le``) and a sample rate. Inside a stage it is a
mono ``float32`` numpy array in [-1, 1].

- ``decode_pcm`` / ``encode_pcm`` convert between the two and reject what
  does not fit (unknown format, a byte count that is not whole samples).
- ``StreamResampler`` converts the rate of a stream that arrives in chunks of
  any size: a Kaiser-windowed sinc interpolator that keeps the input it still
  needs between calls, so chunk boundaries leave no clicks and the output is
  the same however the input was cut. ``resample`` is the one-shot form.
- ``WavStream`` reads a RIFF/WAVE byte stream as it arrives (espeak-ng's
  ``--stdout`` writes a header with placeholder sizes, so the ``data`` chunk
  is taken to run to the end of the stream).
"""

from __future__ import annotations

import math
import struct

import numpy as np
from numpy.typing import NDArray

from workers.backends.base import BackendError

Samples = NDArray[np.float32]

PCM_FORMATS = ("pcm_f32le", "pcm_s16le")
_BYTES_PER_SAMPLE = {"pcm_f32le": 4, "pcm_s16le": 2}
_BLOCK = 8192
"""Outputs computed per vectorized step of the resampler (bounds its memory)."""
_MAX_PHASES = 4096
"""Rate pairs needing more filter phases than this compute their taps per sample."""
_BETA = 8.0
"""Kaiser window shape: about 80 dB stopband."""


class AudioError(BackendError):
    """Audio that cannot be decoded: unknown format, torn samples, bad WAV."""


def decode_pcm(data: bytes, fmt: str) -> Samples:
    """Raw PCM bytes to mono float32 samples in [-1, 1]."""
    width = _BYTES_PER_SAMPLE.get(fmt)
    if width is None:
        raise AudioError(f"unsupported audio format {fmt!r}; expected one of {PCM_FORMATS}")
    if len(data) % width:
        raise AudioError(f"{fmt} audio of {len(data)} bytes is not whole {width}-byte samples")
    if fmt == "pcm_s16le":
        return (np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0).astype(np.float32)
    samples = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.isfinite(samples).all():
        raise AudioError("pcm_f32le audio holds NaN or infinite samples")
    return samples


def encode_pcm(samples: Samples, fmt: str = "pcm_s16le") -> bytes:
    """Float samples to raw PCM bytes; values outside [-1, 1] are clipped."""
    clipped = np.clip(samples, -1.0, 1.0)
    if fmt == "pcm_s16le":
        return np.round(clipped * 32767.0).astype("<i2").tobytes()
    if fmt == "pcm_f32le":
        return clipped.astype("<f4").tobytes()
    raise AudioError(f"unsupported audio format {fmt!r}; expected one of {PCM_FORMATS}")


class StreamResampler:
    """Sample-rate conversion of a chunked stream (Kaiser-windowed sinc).

    Output sample ``k`` sits at input time ``k * src / dst``; it is computed once
    the input reaches ``zero_crossings`` filter lobes past that time, so the
    delay is about a millisecond. When downsampling, the cutoff drops to the
    output's Nyquist rate so nothing aliases.
    """

    def __init__(self, src_rate: int, dst_rate: int, *, zero_crossings: int = 16) -> None:
        if src_rate <= 0 or dst_rate <= 0:
            raise AudioError(f"sample rates must be positive, got {src_rate} -> {dst_rate}")
        self.src_rate = src_rate
        self.dst_rate = dst_rate
        self._cutoff = min(1.0, dst_rate / src_rate) * 0.97
        self._half = math.ceil(zero_crossings / self._cutoff)
        """Filter half-width in input samples."""
        divisor = math.gcd(src_rate, dst_rate)
        self._step = src_rate // divisor
        self._phases = dst_rate // divisor
        """Output k sits at input time ``k * _step / _phases``: that many filter phases."""
        self._table = self._tap_table() if self._phases <= _MAX_PHASES else None
        self._buf: Samples = np.zeros(self._half, dtype=np.float32)
        self._base = -self._half
        """Input index of ``_buf[0]``; the stream starts after ``_half`` zeros."""
        self._received = 0
        self._produced = 0

    @property
    def passthrough(self) -> bool:
        return self.src_rate == self.dst_rate

    def process(self, samples: Samples) -> Samples:
        """Feed input; returns every output sample the input received so far allows."""
        if self.passthrough:
            return samples.astype(np.float32, copy=False)
        self._buf = np.concatenate([self._buf, samples.astype(np.float32, copy=False)])
        self._received += len(samples)
        # Output k is ready when floor(t_k) + half < base + len(buf).
        limit = self._base + len(self._buf) - self._half
        ready = self._count_before(limit)
        return self._emit(ready)

    def flush(self) -> Samples:
        """The outputs still held back at the end of the stream (input padded with zeros)."""
        if self.passthrough:
            return np.zeros(0, dtype=np.float32)
        self._buf = np.concatenate([self._buf, np.zeros(self._half + 1, dtype=np.float32)])
        total = -(-self._received * self.dst_rate // self.src_rate)
        return self._emit(total)

    def _count_before(self, limit: int) -> int:
        """Number of outputs whose input time floor is below ``limit``."""
        if limit <= 0:
            return 0
        return -(-limit * self.dst_rate // self.src_rate)

    def _emit(self, upto: int) -> Samples:
        pieces: list[Samples] = []
        while self._produced < upto:
            stop = min(upto, self._produced + _BLOCK)
            pieces.append(self._compute(self._produced, stop))
            self._produced = stop
        # Keep only the input the next output still needs.
        next_t = self._produced * self._step // self._phases
        keep_from = next_t - self._half + 1
        drop = max(0, min(keep_from - self._base, len(self._buf)))
        if drop:
            self._buf = self._buf[drop:]
            self._base += drop
        if not pieces:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(pieces).astype(np.float32)

    def _kernel(self, distance: NDArray[np.float64]) -> NDArray[np.float64]:
        window_arg = np.clip(1.0 - (distance / self._half) ** 2, 0.0, 1.0)
        window = np.i0(_BETA * np.sqrt(window_arg)) / np.i0(_BETA)
        kernel = self._cutoff * np.sinc(self._cutoff * distance) * window
        return np.asarray(kernel, dtype=np.float64)

    def _tap_table(self) -> NDArray[np.float32]:
        """Filter taps by tap then phase: ``[t, p]`` weighs input ``t`` of an output at
        fraction ``p / _phases`` of an input sample."""
        frac = np.arange(self._phases, dtype=np.float64) / self._phases
        taps = np.arange(2 * self._half, dtype=np.float64)
        table = self._kernel(frac[None, :] + (self._half - 1) - taps[:, None])
        return np.ascontiguousarray(table, dtype=np.float32)

    def _compute(self, start: int, stop: int) -> Samples:
        ks = np.arange(start, stop, dtype=np.int64)
        position = ks * self._step
        whole, phase = position // self._phases, position % self._phases
        first = whole - self._half + 1 - self._base
        table = self._table
        if table is None:
            index = first[:, None] + np.arange(2 * self._half, dtype=np.int64)
            distance = (position / self._phases)[:, None] - (index + self._base)
            kernel = self._kernel(distance).astype(np.float32)
            return np.asarray(np.einsum("ij,ij->i", self._buf[index], kernel), dtype=np.float32)
        # One pass per tap over all outputs: cheaper than gathering an (outputs x taps) matrix.
        out = np.zeros(len(ks), dtype=np.float32)
        for tap in range(2 * self._half):
            out += self._buf[first + tap] * table[tap][phase]
        return out


def resample(samples: Samples, src_rate: int, dst_rate: int) -> Samples:
    """One-shot rate conversion; the output has ``ceil(n * dst / src)`` samples."""
    if src_rate == dst_rate:
        return samples.astype(np.float32, copy=False)
    resampler = StreamResampler(src_rate, dst_rate)
    return np.concatenate([resampler.process(samples), resampler.flush()])


class WavStream:
    """Incremental reader of a mono 16-bit PCM WAV byte stream."""

    def __init__(self) -> None:
        self._pending = b""
        self.sample_rate: int | None = None
        """Known once the header was read."""

    def feed(self, data: bytes) -> Samples:
        """Bytes in, the samples they complete out (empty until the header is whole)."""
        self._pending += data
        if self.sample_rate is None and not self._read_header():
            return np.zeros(0, dtype=np.float32)
        whole = len(self._pending) - len(self._pending) % 2
        chunk, self._pending = self._pending[:whole], self._pending[whole:]
        return decode_pcm(chunk, "pcm_s16le")

    def _read_header(self) -> bool:
        buf = self._pending
        if len(buf) < 12:
            return False
        if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
            raise AudioError("not a RIFF/WAVE stream")
        pos = 12
        rate: int | None = None
        while pos + 8 <= len(buf):
            chunk_id, size = buf[pos : pos + 4], struct.unpack_from("<I", buf, pos + 4)[0]
            if chunk_id == b"data":
                if rate is None:
                    raise AudioError("WAV data chunk before its fmt chunk")
                self.sample_rate = rate
                self._pending = buf[pos + 8 :]
                return True
            if pos + 8 + size > len(buf):
                return False
            if chunk_id == b"fmt ":
                rate = self._check_fmt(buf[pos + 8 : pos + 8 + size])
            pos += 8 + size + (size & 1)
        return False

    @staticmethod
    def _check_fmt(fmt: bytes) -> int:
        if len(fmt) < 16:
            raise AudioError("WAV fmt chunk too short")
        tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", fmt)
        if (tag, channels, bits) != (1, 1, 16):
            raise AudioError(f"expected mono 16-bit PCM WAV, got {channels} ch {bits} bit")
        return int(rate)
