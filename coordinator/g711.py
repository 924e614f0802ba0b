"""G.711 telephone audio (mu-law and A-law), decoded to 16-bit PCM.

The reference API accepts ``audio/pcmu`` and ``audio/pcma`` (beta names
``g711_ulaw`` and ``g711_alaw``): one byte per sample at 8 kHz, as phone
lines carry it. Stages read PCM, so the coordinator expands each byte
through a 256-entry table (ITU-T G.711's segment rule) when it accepts the
audio; the stages resample 8 kHz like any other rate.
"""

from __future__ import annotations

import numpy as np

RATE = 8_000
"""G.711's sample rate."""


def _ulaw(byte: int) -> int:
    code = ~byte & 0xFF
    magnitude = (((code & 0x0F) << 3) + 0x84) << ((code >> 4) & 0x07)
    return 0x84 - magnitude if code & 0x80 else magnitude - 0x84


def _alaw(byte: int) -> int:
    code = byte ^ 0x55
    exponent, mantissa = (code >> 4) & 0x07, code & 0x0F
    magnitude = (
        (mantissa << 4) + 8 if exponent == 0 else ((mantissa << 4) + 0x108) << (exponent - 1)
    )
    return magnitude if code & 0x80 else -magnitude


_TABLES = {
    "g711_ulaw": np.array([_ulaw(b) for b in range(256)], dtype="<i2"),
    "g711_alaw": np.array([_alaw(b) for b in range(256)], dtype="<i2"),
}
FORMATS = frozenset(_TABLES)


def to_pcm16(data: bytes, fmt: str) -> bytes:
    """Little-endian 16-bit PCM for G.711 ``data`` in ``fmt`` (one of ``FORMATS``)."""
    return _TABLES[fmt][np.frombuffer(data, dtype=np.uint8)].tobytes()
