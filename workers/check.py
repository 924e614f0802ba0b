"""Check a pipeline's stage options without loading any model.

``python -m workers --check`` runs this over every stage, so ``duplexq up``
can refuse a typo in a vLLM option (or any stage's option) in one line before
it starts a single process, instead of a thinker dying in its log. Each
backend's own options model does the checking; nothing here loads weights or
starts an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from schemas.config import PipelineConfig, StageConfig, problems


def _vllm(stage: str, options: Mapping[str, Any]) -> None:
    from workers.backends.vllm_options import parse_options

    parse_options(stage, options)


def _minicpmo(stage: str, options: Mapping[str, Any]) -> None:
    from workers.backends.minicpmo_options import parse_minicpmo_options

    parse_minicpmo_options(stage, options)


def _mage_vl(stage: str, options: Mapping[str, Any]) -> None:
    from workers.backends.mage_vl_core import parse_options

    parse_options(stage, options)


def _vad(stage: str, options: Mapping[str, Any]) -> None:
    from workers.backends.vad import VadOptions

    VadOptions.model_validate(dict(options))


def _asr(stage: str, options: Mapping[str, Any]) -> None:
    from workers.backends.asr import AsrOptions

    AsrOptions.model_validate(dict(options))


def _tts(stage: str, options: Mapping[str, Any]) -> None:
    from workers.backends.tts import TtsOptions

    TtsOptions.model_validate(dict(options))


def _echo(stage: str, options: Mapping[str, Any]) -> None:
    from workers.backends.echo import EchoBackend

    EchoBackend(options)


CHECKS: dict[str, Callable[[str, Mapping[str, Any]], None]] = {
    "vllm": _vllm,
    "minicpmo": _minicpmo,
    "mage_vl": _mage_vl,
    "vad": _vad,
    "asr": _asr,
    "tts": _tts,
    "echo": _echo,
}


def stage_problem(stage: StageConfig) -> str | None:
    """One line saying what is wrong with ``stage``'s options, or None."""
    try:
        CHECKS[stage.backend](stage.name, stage.options)
    except ValidationError as exc:
        return f"{stage.backend} stage {stage.name!r}: bad options: {problems(exc)}"
    except ValueError as exc:
        return str(exc).splitlines()[0]
    return None


def pipeline_problems(pipeline: PipelineConfig) -> list[str]:
    """What is wrong with each stage's options, one line per stage at fault."""
    return [line for stage in pipeline.stages if (line := stage_problem(stage)) is not None]
