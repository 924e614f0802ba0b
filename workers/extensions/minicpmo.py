"""The MiniCPM-o 4.5 duplex extension.

MiniCPM-o 4.5 in duplex mode consumes the user's input as a stream of units
(about a second of audio, optionally with a video frame or a stacked pair)
and, after each unit, either speaks or emits its listen token to keep the
floor with the user. This module is the pure part of serving it on vLLM:

- **Sampling.** Per-stage overrides come from the runtime config keys
  ``duplex_stage_max_tokens`` (stage id -> int) and
  ``duplex_stage_sampling_params`` (stage id -> {field: value}). Stage ids
  may be ints or decimal strings (``0`` and ``"0"`` are the same stage). The
  overrides are applied to copies; the defaults are never mutated. When both
  keys set ``max_tokens`` for one stage, the values must agree.
- **Appends.** Multimodal payloads become a run of placeholder tokens whose
  length is the budget of ``workers.extensions.budget`` (video placeholders
  first, then audio, the order of a duplex unit). The first append of a
  request is prefixed with ``context_reserve`` context tokens, room the
  engine fills with the system/context prefix. Token payloads pass through
  untouched; text needs an injected tokenizer callable (without one,
  ``append_text`` raises ``UnsupportedModeError``); a turn commit appends
  nothing and is marked ``commit`` in the plan's metadata. Client metadata is
  never read for the budget.
- **Decisions.** See ``MiniCPMOExtension.decide_output``.

Token ids: the stand-in defaults of ``MiniCPMOTokenIds`` let tests and dry
runs work without a tokenizer; a real deployment resolves them from the
checkpoint's tokenizer with ``MiniCPMOTokenIds.from_token_lookup``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.errors import InvalidInputError, UnsupportedModeError
from schemas.events import (
    PAYLOAD_FOR_MODE,
    AudioPayload,
    CommitPayload,
    InputMode,
    Payload,
    TextPayload,
    TokensPayload,
    UnitPayload,
    VideoPayload,
)
from schemas.fence import Fence, require_fence
from workers.extensions.base import (
    SP,
    AppendPlan,
    Decision,
    DecisionAction,
    RequestBuffer,
    copy_sampling_params,
)
from workers.extensions.budget import (
    UnitBudget,
    audio_payload_budget,
    unit_budget,
    video_payload_budget,
)

EXTENSION_NAME = "minicpmo45"
STAGE_MAX_TOKENS_KEY = "duplex_stage_max_tokens"
STAGE_SAMPLING_KEY = "duplex_stage_sampling_params"

LISTEN_TOKEN = "<|listen|>"
LISTEN_TOKEN_NAMES = (LISTEN_TOKEN, "listen", "listen_token_id")
"""Keys under which an output's special-token metadata may name the listen token."""
COMPLETION_TOKEN_FIELDS = ("token_ids", "cumulative_token_ids")
"""Where a completion carries its tokens: this step's, or all of the completion's."""
PLACEHOLDER_TOKEN = "<unk>"
"""MiniCPM-V/o fill multimodal slots with ``<unk>`` and swap in embeddings."""

DEFAULT_CONTEXT_RESERVE = 64
"""Context tokens reserved on a request's first append for its system prefix."""

TokenizeFn = Callable[[str], Sequence[int]]


@dataclass(frozen=True, slots=True)
class MiniCPMOTokenIds:
    """The special token ids the extension emits and recognises.

    The defaults are stand-ins (small distinct ids, so tests can tell the
    modalities apart), not the checkpoint's ids; use ``from_token_lookup``
    with the tokenizer's ``convert_tokens_to_ids`` in production.
    """

    audio_placeholder_id: int = 2
    image_placeholder_id: int = 3
    context_token_id: int = 1
    listen_token_id: int | None = None
    """Used only when an output carries no special-token metadata."""

    def __post_init__(self) -> None:
        for name in ("audio_placeholder_id", "image_placeholder_id", "context_token_id"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        listen = self.listen_token_id
        if listen is not None and (type(listen) is not int or listen < 0):
            raise ValueError(f"listen_token_id must be a non-negative int, got {listen!r}")

    @classmethod
    def from_token_lookup(cls, lookup: Callable[[str], int | None]) -> MiniCPMOTokenIds:
        """Resolve the ids from a tokenizer's token -> id lookup.

        All placeholders use ``<unk>``, as the model expects; a missing
        ``<|listen|>`` leaves the fallback unset rather than guessing.
        """
        placeholder = lookup(PLACEHOLDER_TOKEN)
        if placeholder is None:
            raise ValueError(f"the tokenizer has no {PLACEHOLDER_TOKEN} token")
        return cls(
            audio_placeholder_id=placeholder,
            image_placeholder_id=placeholder,
            context_token_id=placeholder,
            listen_token_id=lookup(LISTEN_TOKEN),
        )


# --- sampling overrides -----------------------------------------------------
def _stage_index(key: object, stages: int, source: str) -> int:
    """A stage id from config (int or decimal string), checked against the stage count."""
    if isinstance(key, int) and not isinstance(key, bool):
        index = key
    elif isinstance(key, str) and key.isascii() and key.isdigit():
        index = int(key)
    else:
        raise ValueError(f"{source}: {key!r} is not a stage id (use an int or a decimal string)")
    if not 0 <= index < stages:
        raise ValueError(
            f"{source}: stage id {key!r} is out of range; the pipeline has {stages} stage(s)"
        )
    return index


def _per_stage(runtime_config: Mapping[str, Any], key: str, stages: int) -> dict[int, Any]:
    """The mapping under ``key`` with its stage ids normalised to ints."""
    raw = runtime_config.get(key)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{key} must map stage ids to values, not {type(raw).__name__}")
    result: dict[int, Any] = {}
    for stage_key, value in raw.items():
        index = _stage_index(stage_key, stages, key)
        if index in result:
            raise ValueError(f"{key}: stage {index} is given twice")
        result[index] = value
    return result


def parse_stage_overrides(
    runtime_config: Mapping[str, Any], stages: int
) -> dict[int, dict[str, Any]]:
    """Per-stage field overrides from the two runtime config keys (module docstring)."""
    overrides: dict[int, dict[str, Any]] = {}
    for index, fields in _per_stage(runtime_config, STAGE_SAMPLING_KEY, stages).items():
        if not isinstance(fields, Mapping) or not all(isinstance(k, str) for k in fields):
            raise ValueError(f"{STAGE_SAMPLING_KEY}[{index}] must map field names to values")
        overrides[index] = dict(fields)
    for index, max_tokens in _per_stage(runtime_config, STAGE_MAX_TOKENS_KEY, stages).items():
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(
                f"{STAGE_MAX_TOKENS_KEY}[{index}] must be a positive int, got {max_tokens!r}"
            )
        fields = overrides.setdefault(index, {})
        if fields.get("max_tokens", max_tokens) != max_tokens:
            raise ValueError(
                f"stage {index}: {STAGE_MAX_TOKENS_KEY} says {max_tokens} but "
                f"{STAGE_SAMPLING_KEY} says {fields['max_tokens']}"
            )
        fields["max_tokens"] = max_tokens
    return overrides


# --- output reading ---------------------------------------------------------
def _read(obj: object, name: str) -> Any:
    """``obj.name``, or ``obj[name]`` for mappings; None when absent."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _as_token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"completion token_ids must be a sequence of ints, not {value!r}")
    return tuple(int(token) for token in value)


def _completion_of(output: object) -> object | None:
    """The completion of this step: ``output.outputs[0]``, or ``output`` itself."""
    outputs = _read(output, "outputs")
    if outputs is None:
        return output
    if isinstance(outputs, Sequence) and not isinstance(outputs, str | bytes):
        return outputs[0] if outputs else None
    raise TypeError(f"output.outputs must be a sequence, not {type(outputs).__name__}")


def _completion_tokens(completion: object) -> tuple[int, ...]:
    for name in COMPLETION_TOKEN_FIELDS:
        tokens = _as_token_ids(_read(completion, name))
        if tokens:
            return tokens
    return ()


def _listen_id_from(metadata: object) -> int | None:
    """The listen token id named in a special-token mapping, if any."""
    if not isinstance(metadata, Mapping):
        return None
    for name in LISTEN_TOKEN_NAMES:
        value = metadata.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class MiniCPMOExtension:
    """MiniCPM-o 4.5 duplex: unit budgets, per-stage sampling, listen/speak decisions."""

    name = EXTENSION_NAME

    def __init__(
        self,
        token_ids: MiniCPMOTokenIds | None = None,
        *,
        context_reserve: int = DEFAULT_CONTEXT_RESERVE,
        tokenizer: TokenizeFn | None = None,
    ) -> None:
        if type(context_reserve) is not int or context_reserve < 0:
            raise ValueError(f"context_reserve must be a non-negative int, got {context_reserve!r}")
        self.token_ids = token_ids or MiniCPMOTokenIds()
        self.context_reserve = context_reserve
        self._tokenizer = tokenizer

    @property
    def special_token_ids(self) -> Mapping[str, int]:
        """What the shell may attach to outputs as ``special_token_ids``."""
        listen = self.token_ids.listen_token_id
        return {} if listen is None else {LISTEN_TOKEN: listen}

    # --- sampling -------------------------------------------------------------
    def configure_sampling_params(
        self, defaults: Sequence[SP], runtime_config: Mapping[str, Any]
    ) -> list[SP]:
        """Copies of ``defaults`` (one per stage) with the runtime overrides applied."""
        overrides = parse_stage_overrides(runtime_config, len(defaults))
        result: list[SP] = []
        for index, default in enumerate(defaults):
            try:
                result.append(copy_sampling_params(default, overrides.get(index, {})))
            except ValueError as exc:
                raise ValueError(f"stage {index}: {exc}") from exc
        return result

    # --- appends --------------------------------------------------------------
    def plan_append(
        self,
        fence: Fence,
        mode: InputMode,
        payload: Payload,
        *,
        first_append: bool,
        client_meta: Mapping[str, object] | None = None,
    ) -> AppendPlan:
        """The stage-0 prompt tokens for one input event (module docstring).

        ``client_meta`` is accepted so the contract is uniform, but nothing in
        it is used: the budget comes from the payload alone. Its keys are
        listed under ``ignored_client_fields`` in the plan's metadata.
        """
        require_fence(fence)
        mode = InputMode(mode)
        expected = PAYLOAD_FOR_MODE[mode]
        if type(payload) is not expected:
            raise InvalidInputError(
                f"{mode.value} carries a {expected.__name__}, not a {type(payload).__name__}"
            )
        metadata: dict[str, object] = {}
        if client_meta:
            metadata["ignored_client_fields"] = tuple(sorted(map(str, client_meta)))
        if isinstance(payload, TokensPayload):
            return self._plan_literal(fence, mode, payload.token_ids, first_append, metadata)
        if isinstance(payload, TextPayload):
            tokens = self._tokenize(payload.text)
            return self._plan_framed(
                fence, mode, tokens, first_append=first_append, metadata=metadata
            )
        if isinstance(payload, AudioPayload | VideoPayload | UnitPayload):
            budget = self._payload_budget(payload)
            placeholders = self._placeholders(budget)
            metadata["audio_tokens"] = budget.audio_tokens
            metadata["video_tokens"] = budget.video_tokens
            return self._plan_framed(
                fence,
                mode,
                placeholders,
                placeholder_count=len(placeholders),
                first_append=first_append,
                metadata=metadata,
            )
        if not isinstance(payload, CommitPayload):
            raise UnsupportedModeError(f"{mode.value} is not supported by {self.name}")
        # A turn commit appends nothing; the shell starts the response on "commit".
        metadata["commit"] = True
        return self._plan_literal(fence, mode, (), first_append, metadata)

    def _tokenize(self, text: str) -> tuple[int, ...]:
        if self._tokenizer is None:
            raise UnsupportedModeError(
                f"{InputMode.APPEND_TEXT.value} is not supported by {self.name} without a tokenizer"
            )
        return tuple(int(token) for token in self._tokenizer(text))

    @staticmethod
    def _payload_budget(payload: AudioPayload | VideoPayload | UnitPayload) -> UnitBudget:
        if isinstance(payload, AudioPayload):
            return UnitBudget(audio_tokens=audio_payload_budget(payload))
        if isinstance(payload, VideoPayload):
            return UnitBudget(video_tokens=video_payload_budget(payload))
        return unit_budget(payload)

    def _placeholders(self, budget: UnitBudget) -> tuple[int, ...]:
        ids = self.token_ids
        return (ids.image_placeholder_id,) * budget.video_tokens + (
            ids.audio_placeholder_id,
        ) * budget.audio_tokens

    @staticmethod
    def _plan_literal(
        fence: Fence,
        mode: InputMode,
        tokens: Sequence[int],
        first_append: bool,
        metadata: Mapping[str, object],
    ) -> AppendPlan:
        """A plan whose prompt is exactly ``tokens`` (no reserve, no placeholders)."""
        buffer = RequestBuffer(fence=fence, budget=len(tokens), first_append=first_append)
        return AppendPlan(mode, tuple(tokens), buffer, metadata)

    def _plan_framed(
        self,
        fence: Fence,
        mode: InputMode,
        body: tuple[int, ...],
        *,
        placeholder_count: int = 0,
        first_append: bool,
        metadata: dict[str, object],
    ) -> AppendPlan:
        """The context reserve (first append only) followed by ``body``.

        ``body`` is placeholders for multimodal payloads or tokenized text;
        ``placeholder_count`` says how many of its tokens are placeholders.
        """
        reserve = self.context_reserve if first_append else 0
        prompt = (self.token_ids.context_token_id,) * reserve + body
        metadata["context_reserve"] = reserve
        buffer = RequestBuffer(
            fence=fence,
            budget=len(prompt),
            placeholder_count=placeholder_count,
            context_reserve=reserve,
            first_append=first_append,
        )
        return AppendPlan(mode, prompt, buffer, metadata)

    # --- decisions ------------------------------------------------------------
    def decide_output(
        self,
        output: object,
        *,
        segment_token_ids: Sequence[int] = (),
        segment_metadata: Mapping[str, object] | None = None,
    ) -> Decision:
        """LISTEN, SPEAK or CONTINUE for one engine output.

        Reads, as attributes or mapping keys:

        - ``output.outputs[0]``, the completion of this step (when ``outputs``
          is absent, ``output`` itself is taken as the completion; when it is
          empty the decision is CONTINUE);
        - the completion's ``token_ids`` (or, when it has none,
          ``cumulative_token_ids``), ``text``, ``stop_reason`` and
          ``finish_reason``;
        - the listen token id, from the first ``special_token_ids`` mapping
          found on the output, in the output's ``multimodal_output``, in
          ``segment_metadata`` or on the completion, under ``<|listen|>``,
          ``listen`` or ``listen_token_id``; failing those,
          ``MiniCPMOTokenIds.listen_token_id``;
        - ``segment_token_ids``: the raw tokens the shell streamed for the
          current segment, read alongside the completion's own.

        LISTEN needs the listen id among those tokens, or a stop reason equal
        to that id or to the listen token's name. Token history kept on the
        outer output object (prompt, or ``token_ids`` / ``cumulative_token_ids``
        of the whole request) is never consulted: a listen token from an
        earlier segment must not end this one. The listen token is removed
        from a LISTEN decision's token ids and text; the rest is content
        spoken before it. A LISTEN decision's metadata says
        ``duplex_native_decision: "listen"`` and ``model_listen: True``.
        """
        completion = _completion_of(output)
        if completion is None:
            return Decision(DecisionAction.CONTINUE, metadata={"reason": "no completion"})
        listen_id = self._listen_id(output, completion, segment_metadata)
        token_ids = _completion_tokens(completion)
        text = _read(completion, "text") or ""
        stop_reason = _read(completion, "stop_reason")
        metadata: dict[str, object] = {}
        finish_reason = _read(completion, "finish_reason")
        if finish_reason is not None:
            metadata["finish_reason"] = str(finish_reason)
        if stop_reason is not None:
            metadata["stop_reason"] = stop_reason

        seen = token_ids + tuple(int(token) for token in segment_token_ids)
        if listen_id is not None and self._is_listen(listen_id, seen, stop_reason):
            metadata.update(
                listen_token_id=listen_id, duplex_native_decision="listen", model_listen=True
            )
            spoken = tuple(token for token in token_ids if token != listen_id)
            return Decision(
                DecisionAction.LISTEN, spoken, str(text).replace(LISTEN_TOKEN, ""), metadata
            )
        if token_ids or text:
            return Decision(DecisionAction.SPEAK, token_ids, str(text), metadata)
        return Decision(DecisionAction.CONTINUE, (), "", metadata)

    def _listen_id(
        self, output: object, completion: object, segment_metadata: Mapping[str, object] | None
    ) -> int | None:
        """The listen token id (see ``decide_output`` for where it is looked up)."""
        for source in (
            _read(output, "special_token_ids"),
            _read(_read(output, "multimodal_output"), "special_token_ids"),
            _read(segment_metadata, "special_token_ids"),
            _read(completion, "special_token_ids"),
        ):
            listen_id = _listen_id_from(source)
            if listen_id is not None:
                return listen_id
        return self.token_ids.listen_token_id

    @staticmethod
    def _is_listen(listen_id: int, token_ids: tuple[int, ...], stop_reason: object) -> bool:
        if listen_id in token_ids:
            return True
        if isinstance(stop_reason, bool):
            return False
        if isinstance(stop_reason, int):
            return stop_reason == listen_id
        return isinstance(stop_reason, str) and stop_reason in LISTEN_TOKEN_NAMES
