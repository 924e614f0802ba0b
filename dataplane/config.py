"""Settings and pipelines as a process reads them: a file, the environment, a flag."""

from __future__ import annotations

from pathlib import Path

from schemas.config import PipelineConfig, Settings, echo_pipeline, load_mapping, load_pipeline


def load_settings(path: Path | None, redis_url: str | None) -> Settings:
    settings = Settings.model_validate(load_mapping(path)) if path else Settings()
    settings = settings.with_env()
    if redis_url:
        settings = settings.model_copy(update={"redis_url": redis_url})
    return settings


def load_pipeline_or_echo(path: Path | None) -> PipelineConfig:
    return load_pipeline(path) if path else echo_pipeline()
