"""Every session field a ``session.update`` may name, judged one by one.

A field either takes effect or is refused by name; a refused field never discards
the rest of the update (the other fields apply, and ``session.updated`` shows
them). ``judged`` walks the update in the GA shape (``type: "realtime"``, nested
``audio``) or the beta's flat one, and looks every field up in one table
(``GA_FIELDS``, ``BETA_FIELDS``): its rule turns the client's value into changes of
``SessionConfig`` or refuses it. A refusal is ``unsupported_field`` (the field
asks for what duplexq does not do) or ``invalid_event`` (a value the field cannot
take); either way its ``param`` names the field (``session.audio.output.speed``).
A field the table does not know is refused as unsupported.

What each field does is in docs/realtime.md ("Session settings").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from pydantic import ValidationError

from schemas.errors import ErrorCode, ProtocolError
from schemas.realtime import SessionConfig

FORMATS = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
"""GA input format types and the internal (beta) format each means."""

OUTPUT_RATE = 24_000
"""The one output format duplexq produces: 16-bit PCM at this rate."""

MAX_OUTPUT_TOKENS = 4096
"""The largest ``max_output_tokens`` a session may ask for (``"inf"``: the stage's own)."""

EAGERNESS_SILENCE_MS = {"high": 300, "medium": 700, "auto": 700, "low": 1500}
"""``semantic_vad``'s eagerness as the silence that ends a turn on the VAD stage."""

_TURN_FIELDS = frozenset({
    "type", "threshold", "prefix_padding_ms", "silence_duration_ms", "interrupt_response",
    "create_response", "eagerness", "idle_timeout_ms",
})  # fmt: skip


class Refusal(NamedTuple):
    """One field of an update that did not take effect."""

    param: str
    code: ErrorCode
    message: str

    def error(self) -> ProtocolError:
        return FieldError(self.code, f"{self.param}: {self.message}", self.param)


class FieldError(ProtocolError):
    """A session field refused; ``param`` names it (the error event's ``param``)."""

    def __init__(self, code: ErrorCode, message: str, param: str) -> None:
        super().__init__(code, message)
        self.param = param


class _Refused(Exception):
    """A field's value refused: ``unsupported`` (what duplexq does not do) or not;
    ``inner`` names the part of the value at fault (a key of an object), if one."""

    def __init__(self, message: str, inner: str = "", *, unsupported: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.inner = inner
        self.unsupported = unsupported


Rule = Callable[[Any], dict[str, Any]]
"""A field's value -> the ``SessionConfig`` changes it makes; raises ``_Refused``."""


def _set(name: str) -> Rule:
    return lambda value: {name: value}


def _only(*allowed: object, why: str) -> Rule:
    def rule(value: Any) -> dict[str, Any]:
        if value not in allowed:
            raise _Refused(why)
        return {}

    return rule


def _output_modalities(value: Any) -> dict[str, Any]:
    if isinstance(value, list | tuple) and len(value) > 1:
        raise _Refused('takes one modality, ["audio"] or ["text"] (audio carries its transcript)')
    return {"modalities": value}


def _max_output_tokens(value: Any) -> dict[str, Any]:
    if value == "inf":
        return {"max_output_tokens": None}
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_OUTPUT_TOKENS:
        return {"max_output_tokens": value}
    raise _Refused(f'must be an integer from 1 to {MAX_OUTPUT_TOKENS}, or "inf"', unsupported=False)


def _input_format(value: Any) -> dict[str, Any]:
    fmt = value or {}
    if not isinstance(fmt, dict):
        raise _Refused("must be an object with a type", unsupported=False)
    kind = fmt.get("type", "audio/pcm")
    changes: dict[str, Any] = {"input_audio_format": FORMATS.get(kind, kind)}
    if "rate" in fmt:
        changes["input_audio_sample_rate"] = fmt["rate"]
    return changes


def _output_format(value: Any) -> dict[str, Any]:
    fmt = value or {}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("audio/pcm", "pcm16", None):
        raise _Refused(f"duplexq speaks audio/pcm at {OUTPUT_RATE} Hz only")
    if fmt.get("rate", OUTPUT_RATE) != OUTPUT_RATE:
        raise _Refused(f"duplexq speaks audio/pcm at {OUTPUT_RATE} Hz only")
    return {}


def _beta_output_format(value: Any) -> dict[str, Any]:
    return _output_format({"type": value})


def _turn_detection(value: Any) -> dict[str, Any]:
    if value is None:
        return {"turn_detection": None}
    if not isinstance(value, dict):
        raise _Refused("must be an object or null", unsupported=False)
    for key in value:
        if key not in _TURN_FIELDS:
            raise _Refused("is not a turn detection setting duplexq has", key)
    if value.get("create_response", True) is not True:
        raise _Refused("the end of a turn always asks for a response", "create_response")
    if value.get("idle_timeout_ms") is not None:
        raise _Refused("no idle timeout: a turn ends on speech only", "idle_timeout_ms")
    return {"turn_detection": {k: v for k, v in value.items() if k not in _CHECKED_HERE}}


_CHECKED_HERE = ("create_response", "idle_timeout_ms")


def _transcription(value: Any) -> dict[str, Any]:
    """The pipeline's speech stage transcribes the user's speech whatever this says
    (the model reads its transcript); ``language`` and ``prompt`` it cannot take."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Refused("must be an object or null", unsupported=False)
    for key in ("language", "prompt"):
        if value.get(key):
            raise _Refused("the speech stage takes no transcription hints", key)
    return {}


def _speed(value: Any) -> dict[str, Any]:
    if isinstance(value, int | float) and not isinstance(value, bool) and 0.25 <= value <= 1.5:
        return {"speed": float(value)}
    raise _Refused("must be a number from 0.25 to 1.5", unsupported=False)


def _object(value: Any) -> dict[str, Any]:
    """``audio`` and its sides are objects (walked field by field when they are)."""
    raise _Refused("must be an object", unsupported=False)


GA_FIELDS: dict[str, Rule] = {
    "type": _only("realtime", why='only "realtime" sessions are served'),
    "model": lambda value: {},  # the pipeline's own model serves: sessions report "duplexq"
    "instructions": _set("instructions"),
    "output_modalities": _output_modalities,
    "max_output_tokens": _max_output_tokens,
    "tools": _set("tools"),
    "tool_choice": _set("tool_choice"),
    "tracing": _only(None, why="no tracing is recorded; leave it out or null"),
    "truncation": _only(
        "auto", why='the oldest exchanges are dropped when the context is full: "auto" only'
    ),
    "include": _only(None, [], why="no extra output can be included; leave it out or empty"),
    "prompt": _only(None, why="no stored prompts: send instructions"),
    "audio": _object,
    "audio.input": _object,
    "audio.output": _object,
    "audio.input.format": _input_format,
    "audio.input.turn_detection": _turn_detection,
    "audio.input.transcription": _transcription,
    "audio.input.noise_reduction": _only(None, why="no noise reduction is applied; leave it null"),
    "audio.output.format": _output_format,
    "audio.output.voice": _set("voice"),
    "audio.output.speed": _speed,
}
"""GA session fields (their path under ``session``) and their rules."""

BETA_FIELDS: dict[str, Rule] = {
    "instructions": _set("instructions"),
    "modalities": _set("modalities"),  # the beta's ["text", "audio"] is audio
    "input_audio_format": _set("input_audio_format"),
    "input_audio_sample_rate": _set("input_audio_sample_rate"),
    "output_audio_format": _beta_output_format,
    "voice": _set("voice"),
    "speed": _speed,
    "turn_detection": _turn_detection,
    "tools": _set("tools"),
    "tool_choice": _set("tool_choice"),
    "max_response_output_tokens": _max_output_tokens,
    "input_audio_transcription": _transcription,
    "input_audio_noise_reduction": GA_FIELDS["audio.input.noise_reduction"],
    "tracing": GA_FIELDS["tracing"],
    "truncation": GA_FIELDS["truncation"],
    "include": GA_FIELDS["include"],
    "prompt": GA_FIELDS["prompt"],
    "model": GA_FIELDS["model"],
}
"""The beta's flat session fields and their rules."""


def is_ga(update: dict[str, Any]) -> bool:
    return update.get("type") == "realtime" or "audio" in update or "output_modalities" in update


def _fields(update: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(path, value) of every field an update names; ``audio`` is walked two levels."""
    for name, value in update.items():
        if name != "audio" or not is_ga(update):
            yield name, value
            continue
        if not isinstance(value, dict):
            yield "audio", value
            continue
        for side, settings in value.items():
            if side not in ("input", "output") or not isinstance(settings, dict):
                yield f"audio.{side}", settings
                continue
            for key, setting in settings.items():
                yield f"audio.{side}.{key}", setting


def judged(current: SessionConfig, update: dict[str, Any]) -> tuple[SessionConfig, list[Refusal]]:
    """``current`` with every field of ``update`` that can take effect applied, and the
    refusals of the others, in the order the update names them."""
    table = GA_FIELDS if is_ga(update) else BETA_FIELDS
    config, refusals = current, []
    for path, value in _fields(update):
        param = f"session.{path}"
        rule = table.get(path)
        if rule is None:
            refusals.append(Refusal(param, ErrorCode.UNSUPPORTED_FIELD, "is not supported"))
            continue
        try:
            changes = rule(value)
            config = SessionConfig.model_validate({**config.model_dump(), **changes})
        except _Refused as exc:
            where = f"{param}.{exc.inner}" if exc.inner else param
            code = ErrorCode.UNSUPPORTED_FIELD if exc.unsupported else ErrorCode.INVALID_EVENT
            refusals.append(Refusal(where, code, exc.message))
        except ValidationError as exc:
            first = exc.errors()[0]
            inner = ".".join(str(part) for part in first["loc"][1:])
            where = f"{param}.{inner}" if inner else param
            refusals.append(Refusal(where, ErrorCode.INVALID_EVENT, first["msg"]))
    return config, refusals
