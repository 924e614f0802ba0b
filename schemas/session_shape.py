"""A session's configuration in the Realtime API's shapes, in and out.

``session.update`` is read in the GA shape (``type: "realtime"``,
``output_modalities``, ``audio.input.format``, ``audio.input.turn_detection``,
``audio.output.voice``) and, for clients written against the beta, in its flat
shape (``modalities``, ``input_audio_format``, ``turn_detection``, ``voice``);
``schemas.session_fields`` judges each field. An update changes only the fields
it names (``turn_detection: null`` names one: server VAD off).
``session.created`` and ``session.updated`` carry the GA session object
(``session_object``), which the official SDK's types validate
(``tests/test_realtime_conformance.py``).
"""

from __future__ import annotations

from typing import Any

from schemas.errors import ErrorCode
from schemas.events import SettingsPayload
from schemas.realtime import SessionConfig
from schemas.session_fields import EAGERNESS_SILENCE_MS, FORMATS, OUTPUT_RATE, judged
from schemas.tools import choice_text, tools_text

MODEL = "duplexq"
_TYPES = {internal: ga for ga, internal in FORMATS.items()}


def merged(current: SessionConfig, update: dict[str, Any]) -> SessionConfig:
    """``current`` with what ``update`` names changed (either shape) where it can take
    effect (``schemas.session_fields``); a value the session cannot take raises
    ValueError naming its field. A field duplexq does not do is left out: a connection
    reports it to the client (``judged``)."""
    config, refusals = judged(current, update)
    for refusal in refusals:
        if refusal.code is not ErrorCode.UNSUPPORTED_FIELD:
            raise ValueError(f"{refusal.param}: {refusal.message}")
    return config


def session_object(session_id: str, config: SessionConfig) -> dict[str, Any]:
    """The GA session object of ``session.created`` / ``session.updated``."""
    fmt: dict[str, Any] = {"type": _TYPES.get(config.input_audio_format)}
    if config.input_audio_format == "pcm16":
        fmt["rate"] = config.input_audio_sample_rate
    elif fmt["type"] is None:  # duplexq's own format, beside the standard ones
        fmt = {"type": f"audio/{config.input_audio_format}", "rate": config.input_audio_sample_rate}
    detection = (
        config.turn_detection.model_dump(exclude_none=True) if config.turn_detection else None
    )
    output: dict[str, Any] = {
        "format": {"type": "audio/pcm", "rate": OUTPUT_RATE},
        "speed": config.speed,
    }
    if config.voice:
        output["voice"] = config.voice
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": MODEL,
        "output_modalities": list(config.modalities or ("audio",)),
        "instructions": config.instructions or "",
        "max_output_tokens": config.max_output_tokens or "inf",
        "tools": [tool.model_dump() for tool in config.tools],
        "tool_choice": (
            config.tool_choice.model_dump()
            if not isinstance(config.tool_choice, str)
            else config.tool_choice
        ),
        "audio": {"input": {"format": fmt, "turn_detection": detection}, "output": output},
    }


def stage_settings(config: SessionConfig) -> SettingsPayload:
    """What the stages act on of a session's configuration (``SettingsPayload``)."""
    detection = config.turn_detection
    return SettingsPayload(
        instructions=config.instructions or "",
        audio_output=config.modalities is None or "audio" in config.modalities,
        voice=config.voice or "",
        server_vad=detection is not None,
        vad_threshold=detection.threshold if detection else None,
        vad_silence_ms=_silence_ms(config),
        vad_prefix_padding_ms=detection.prefix_padding_ms if detection else None,
        interrupt_response=detection.interrupt_response if detection else False,
        tools=tools_text(config.tools),
        tool_choice=choice_text(config.tool_choice),
        greedy=config.greedy,
        max_output_tokens=config.max_output_tokens,
        speed=config.speed,
    )


def _silence_ms(config: SessionConfig) -> int | None:
    """The silence that ends a turn: server VAD's own, or semantic VAD's eagerness."""
    detection = config.turn_detection
    if detection is None:
        return None
    if detection.type == "semantic_vad":
        return EAGERNESS_SILENCE_MS[detection.eagerness or "auto"]
    return detection.silence_duration_ms


def settings_from_json(raw: str | bytes | None) -> SettingsPayload:
    """The stage settings of a configuration stored as JSON (the session meta's
    ``config``); the defaults when none is stored."""
    if not raw:
        return SettingsPayload()
    return stage_settings(SessionConfig.model_validate_json(raw))
