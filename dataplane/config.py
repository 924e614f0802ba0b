"""Settings and pipelines as a process reads them: a file, the environment, a flag.

Every command loads them here, so every command has the same defaults (the
pipeline and Redis URL in the settings) and the same one-line errors:
``ConfigError`` for a mistake in a file, a variable or a flag, and
``RedisUnreachable`` when the settings' Redis does not answer within 2 s.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import ValidationError
from redis.exceptions import RedisError

from dataplane.bus import RedisBus
from schemas.config import (
    ConfigError,
    PipelineConfig,
    Settings,
    load_mapping,
    load_pipeline,
    unknown_variables,
)
from schemas.config import problems as validation_problems

DEFAULT_PIPELINE = Path(__file__).resolve().parent.parent / "configs" / "default.toml"
"""The shipped pipeline, used when neither ``--pipeline`` nor ``settings.pipeline`` names one."""
REACH_TIMEOUT_S = 1.5
"""How long a command waits for Redis to answer before it says it cannot reach it."""


class RedisUnreachable(RuntimeError):
    """The settings' Redis did not answer a PING in time."""


def check_environment() -> None:
    """ConfigError naming every ``DUPLEXQ_*`` variable that no part of duplexq reads (a
    misspelt setting would otherwise be ignored without a word)."""
    unknown = unknown_variables(os.environ)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise ConfigError(
            f"unknown environment variable{plural} {', '.join(unknown)}; settings are "
            "DUPLEXQ_<FIELD>, for the fields in schemas/config.py"
        )


def load_settings(path: Path | None, redis_url: str | None) -> Settings:
    """Settings from ``path`` (if any), then ``DUPLEXQ_*`` variables, then ``--redis-url``;
    ConfigError for a bad value or an unknown ``DUPLEXQ_*`` variable."""
    check_environment()
    where = f"settings {path}" if path else "settings"
    values = load_mapping(path) if path else {}
    try:
        settings = Settings.from_file(values)
    except ValidationError as exc:
        fields = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
        if any(f"DUPLEXQ_{name.upper()}" in os.environ for name in fields):
            where += " (DUPLEXQ_* environment)"
        raise ConfigError(f"{where}: {validation_problems(exc)}") from exc
    if redis_url:
        settings = settings.model_copy(update={"redis_url": redis_url})
    return settings


def pipeline_path(settings: Settings, path: Path | None) -> Path:
    """``--pipeline``, else ``settings.pipeline``, else the shipped default pipeline."""
    return path or (Path(settings.pipeline) if settings.pipeline else DEFAULT_PIPELINE)


def load_pipeline_for(settings: Settings, path: Path | None) -> PipelineConfig:
    """The pipeline a command serves (see ``pipeline_path``); ConfigError if it is bad."""
    return load_pipeline(pipeline_path(settings, path))


def check_stage(pipeline: PipelineConfig, stage: str, path: Path | str) -> None:
    """ConfigError unless ``stage`` is one of the pipeline's stages."""
    if stage not in pipeline.stage_names:
        raise ConfigError(
            f"stage {stage!r} is not in pipeline {path} "
            f"(its stages: {', '.join(pipeline.stage_names)})"
        )


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    host = parts.netloc.rsplit("@", 1)[-1]
    return parts._replace(netloc=user + host).geturl()


async def ensure_redis(url: str, within_s: float = REACH_TIMEOUT_S) -> None:
    """Return once Redis answers a PING; RedisUnreachable after ``within_s`` seconds."""
    bus = RedisBus(url, command_timeout=within_s)
    try:
        async with asyncio.timeout(within_s):
            await bus.client.ping()
    except (TimeoutError, RedisError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {within_s:g} s"
        raise RedisUnreachable(f"cannot reach Redis at {redacted(url)}: {reason}") from exc
    finally:
        await bus.aclose()
