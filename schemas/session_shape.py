"""A session's configuration in the Realtime API's shapes, in and out.

``session.update`` is read in the GA shape (``type: "realtime"``,
``output_modalities``, ``audio.input.format``, ``audio.input.turn_detection``,
``audio.output.voice``) and, for clients written against the beta, in its flat
shape (``modalities``, ``input_audio_format``, ``turn_detection``, ``voice``).
An update changes only the fields it names (``turn_detection: null`` names
one: server VAD off). ``session.created`` and ``session.updated`` carry the
GA session object (``session_object``), which the official SDK's types
validate (``tests/test_realtime_conformance.py``).
"""

from __future__ import annotations

from typing import Any

from schemas.events import SettingsPayload
from schemas.realtime import SessionConfig
from schemas.tools import choice_text, tools_text

MODEL = "duplexq"
_FORMATS = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
"""GA input format types and the internal (beta) format each means."""
_TYPES = {internal: ga for ga, internal in _FORMATS.items()}


def _ga_fields(session: dict[str, Any]) -> dict[str, Any]:
    """The internal fields a GA-shaped session object names."""
    fields: dict[str, Any] = {}
    if "instructions" in session:
        fields["instructions"] = session["instructions"]
    if "output_modalities" in session:
        fields["modalities"] = session["output_modalities"]
    audio = session.get("audio") or {}
    source = audio.get("input") or {}
    if "format" in source:
        fmt = source["format"] or {}
        kind = fmt.get("type", "audio/pcm")
        fields["input_audio_format"] = _FORMATS.get(kind, kind)
        if "rate" in fmt:
            fields["input_audio_sample_rate"] = fmt["rate"]
    if "turn_detection" in source:
        fields["turn_detection"] = source["turn_detection"]
    sink = audio.get("output") or {}
    if "voice" in sink:
        fields["voice"] = sink["voice"]
    for name in ("tools", "tool_choice"):
        if name in session:
            fields[name] = session[name]
    return fields


BETA_FIELDS = ("instructions", "modalities", "input_audio_format", "input_audio_sample_rate",
               "output_audio_format", "voice", "turn_detection", "tools",
               "tool_choice")  # fmt: skip


def merged(current: SessionConfig, update: dict[str, Any]) -> SessionConfig:
    """``current`` with what ``update`` names changed (either shape); raises pydantic's
    ValidationError for a value the session cannot take."""
    if update.get("type") == "realtime" or "audio" in update or "output_modalities" in update:
        changes = _ga_fields(update)
    else:
        changes = {name: update[name] for name in BETA_FIELDS if name in update}
    return SessionConfig.model_validate({**current.model_dump(), **changes})


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
    output: dict[str, Any] = {"format": {"type": "audio/pcm", "rate": 24_000}}
    if config.voice:
        output["voice"] = config.voice
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": MODEL,
        "output_modalities": list(config.modalities or ("audio",)),
        "instructions": config.instructions or "",
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
        vad_silence_ms=detection.silence_duration_ms if detection else None,
        vad_prefix_padding_ms=detection.prefix_padding_ms if detection else None,
        interrupt_response=detection.interrupt_response if detection else False,
        tools=tools_text(config.tools),
        tool_choice=choice_text(config.tool_choice),
        greedy=config.greedy,
    )


def settings_from_json(raw: str | bytes | None) -> SettingsPayload:
    """The stage settings of a configuration stored as JSON (the session meta's
    ``config``); the defaults when none is stored."""
    if not raw:
        return SettingsPayload()
    return stage_settings(SessionConfig.model_validate_json(raw))
