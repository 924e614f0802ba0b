"""Options of a ``minicpmo`` stage (``StageConfig.options``), validated when the backend is built.

They extend the ``vllm`` stage's options (``VllmOptions``): the engine fields
(``model`` .. ``seed``) mean the same and configure the one engine a worker
runs; ``max_tokens``, ``temperature``, ``top_p`` and ``seed`` are the
defaults of the stage-0 sampling parameters (one short continuation per
unit), and ``history_max_tokens`` bounds the session prompt. The chat fields
(``system_prompt``, ``history_max_messages``) have no meaning here and are
refused when set.

The duplex fields are handed to the model extension as its runtime config:
``duplex_stage_max_tokens`` and ``duplex_stage_sampling_params`` (stage id
-> value, see ``workers.extensions.minicpmo``). This stage runs pipeline
stage 0 only, so stage ids other than 0 are refused here, before any engine
starts. Field names are checked against vLLM's ``SamplingParams`` when the
engine is ready (a bad name fails the first request, as a ``BackendError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import Field, ValidationError, model_validator

from workers.backends.vllm_options import MultimodalVllmOptions
from workers.extensions.minicpmo import (
    DEFAULT_CONTEXT_RESERVE,
    STAGE_MAX_TOKENS_KEY,
    STAGE_SAMPLING_KEY,
    parse_stage_overrides,
)

DUPLEX_STAGES = 1
"""Pipeline stages this backend serves: stage 0 (the thinker's decisions and text)."""
UNUSED_CHAT_FIELDS = ("system_prompt", "history_max_messages")
RESERVED_SAMPLING_FIELDS = frozenset({"n", "output_kind", "detokenize"})
"""Set by the stage itself: one streamed, detokenized completion per unit."""


class MiniCPMOOptions(MultimodalVllmOptions):
    """What a ``minicpmo`` stage's ``options`` table may hold."""

    max_tokens: int = Field(8, ge=1)
    """Most tokens the model generates for one unit (stage-0 default; a
    ``duplex_stage_max_tokens`` entry for stage 0 wins)."""
    send_media: bool | None = None
    """Whether requests carry each unit's frames and audio as ``multi_modal_data``;
    unset: when vLLM serves the model as multimodal (a text model takes placeholders
    alone)."""
    image_marker: str = Field("(<image>./</image>)", min_length=1, max_length=64)
    """What vLLM's processor for the model expands into one image's tokens; with
    ``send_media`` each frame is sent as one (MiniCPM-o's marker by default)."""
    audio_marker: str = Field("(<audio>./</audio>)", min_length=1, max_length=64)
    """What vLLM's processor for the model expands into one audio's tokens; with
    ``send_media`` each unit's audio is sent as one (MiniCPM-o's marker by default)."""
    context_reserve: int = Field(DEFAULT_CONTEXT_RESERVE, ge=0, le=65_536)
    """Context tokens the first append of a session reserves for the system prefix."""
    listen_stops: bool = True
    """Add the listen token to the stage-0 stop ids: a unit's generation ends as soon
    as the model yields the floor."""
    duplex_stage_max_tokens: dict[int | str, int] = Field(default_factory=dict)
    """Stage id -> max_tokens, passed to the extension's ``configure_sampling_params``."""
    duplex_stage_sampling_params: dict[int | str, dict[str, Any]] = Field(default_factory=dict)
    """Stage id -> {SamplingParams field: value}, passed the same way (e.g.
    ``{"0" = {temperature = 0.0, logit_bias = ...}}``)."""

    @model_validator(mode="after")
    def _check_duplex(self) -> Self:
        unused = [name for name in UNUSED_CHAT_FIELDS if name in self.model_fields_set]
        if unused:
            raise ValueError(f"{', '.join(unused)}: not used by the minicpmo stage")
        overrides = parse_stage_overrides(self.runtime_config(), DUPLEX_STAGES)
        reserved = sorted(RESERVED_SAMPLING_FIELDS & set(overrides.get(0, {})))
        if reserved:
            raise ValueError(f"{STAGE_SAMPLING_KEY}: {', '.join(reserved)} are set by the stage")
        if self.unit_max_tokens >= self.max_model_len:
            raise ValueError(
                f"a unit's max_tokens ({self.unit_max_tokens}) must be below "
                f"max_model_len ({self.max_model_len})"
            )
        return self

    def runtime_config(self) -> dict[str, Any]:
        """The extension's runtime config: the two duplex keys."""
        return {
            STAGE_MAX_TOKENS_KEY: dict(self.duplex_stage_max_tokens),
            STAGE_SAMPLING_KEY: {k: dict(v) for k, v in self.duplex_stage_sampling_params.items()},
        }

    @property
    def unit_max_tokens(self) -> int:
        """Most tokens one unit's request generates, overrides applied."""
        overrides = parse_stage_overrides(self.runtime_config(), DUPLEX_STAGES)
        value = overrides.get(0, {}).get("max_tokens", self.max_tokens)
        return int(value)

    @property
    def prompt_budget(self) -> int:
        """Most prompt tokens one unit's request may carry."""
        room = self.max_model_len - self.unit_max_tokens
        if self.history_max_tokens is not None:
            return min(self.history_max_tokens, room)
        return room


def parse_minicpmo_options(stage: str, options: Mapping[str, Any]) -> MiniCPMOOptions:
    """Validate a stage's options; raises ValueError naming the stage and each bad field."""
    try:
        return MiniCPMOOptions.model_validate(dict(options))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'options'}: {err['msg']}" for err in exc.errors()
        )
        raise ValueError(f"minicpmo stage {stage!r}: bad options: {problems}") from exc
