"""Configuration: runtime settings and the pipeline, each loaded from one file.

``Settings`` holds what every process needs (Redis, leases, batching,
retention); it is a ``pydantic-settings`` model: any field can be set by an
environment variable named ``DUPLEXQ_<FIELD>`` (upper case), which overrides a
settings file (``from_file``). ``PipelineConfig`` names the stages and how
their outputs feed each other. Both are pydantic models: they come from users,
so they are validated fully when loaded.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from schemas.settings import (
    AccessSettings,
    ClientLimitSettings,
    DataPlaneSettings,
    OwnershipSettings,
    RedisSettings,
    ResumeSettings,
    RetentionSettings,
    ServerSettings,
)

REDIS_PERSISTENCE = ("--appendonly", "yes", "--appendfsync", "always")
"""How every Redis that duplexq starts persists (``up``, compose, the tests).

An input is acknowledged to the client only after the script that appended it
returned, and with ``appendfsync always`` Redis writes and fsyncs the AOF
before it sends any reply: an acknowledged input survives kill -9 of Redis and
a crash of its host. ``everysec`` is not enough even for a process crash: when
the disk is slow Redis postpones the AOF write while it keeps replying, and a
restart then rolls the session back under live processes. The price is one
fsync per Redis event loop round, shared by every command of that round
(docs/data-plane.md, ``tests/test_redis_restart.py``)."""

SESSION_INPUT = "session"
"""The ``input`` of a stage that reads the session's input log."""

_STAGE_NAME = r"^[a-z][a-z0-9_]{0,31}$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Settings(
    BaseSettings,
    RedisSettings,
    OwnershipSettings,
    DataPlaneSettings,
    RetentionSettings,
    ServerSettings,
    AccessSettings,
    ClientLimitSettings,
    ResumeSettings,
):
    """Process-wide settings shared by coordinators, workers and the control plane; their
    fields come in sections by concern (``schemas.settings``)."""

    model_config = SettingsConfigDict(
        env_prefix="DUPLEXQ_", extra="forbid", frozen=True, use_attribute_docstrings=True
    )

    @model_validator(mode="after")
    def _check_outbound(self) -> Self:
        # One journal read hands a connection up to read_batch events at once, before its
        # socket can take any: a queue that holds fewer would drop readers that keep up.
        if self.max_outbound_events < 4 * self.read_batch:
            raise ValueError(
                f"max_outbound_events ({self.max_outbound_events}) must be at least 4 x "
                f"read_batch ({self.read_batch})"
            )
        return self

    @property
    def queue_redis_url(self) -> str:
        """Where the control plane's job queue lives (``control_redis_url`` or the data
        plane's Redis)."""
        if self.control_redis_url:
            return self.control_redis_url
        if self.redis_url.startswith(("redis+cluster://", "rediss+cluster://")):
            raise ValueError("a Redis Cluster data plane needs control_redis_url (arq needs "
                             "one plain Redis for its job queue)")  # fmt: skip
        return self.redis_url

    def to_env(self) -> dict[str, str]:
        """The settings as ``DUPLEXQ_*`` variables (what ``Settings()`` reads back)."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            text = ",".join(value) if isinstance(value, tuple) else str(value)
            env[f"DUPLEXQ_{name.upper()}"] = text
        return env

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Arguments, then DUPLEXQ_* variables; no .env or secrets files are read.
        return init_settings, env_settings

    @classmethod
    def from_file(cls, values: Mapping[str, Any]) -> Settings:
        """Settings from a file's ``values`` with ``DUPLEXQ_*`` variables over them;
        ValidationError when either is wrong."""
        return cls(**{**values, **EnvSettingsSource(cls)()})


SECTIONS: tuple[type[BaseModel], ...] = tuple(
    base for base in Settings.__bases__ if base is not BaseSettings
)
"""The sections of ``Settings`` (``schemas.settings``), in the order it lists them."""


ENV_PREFIX = "DUPLEXQ_"
"""Every environment variable of duplexq's starts with this: ``DUPLEXQ_<FIELD>`` for each
``Settings`` field, and the names in ``OTHER_VARIABLES``."""

OTHER_VARIABLES: dict[str, str] = {
    "DUPLEXQ_LIFELINE_FD": "set by `duplexq up` for its children (dataplane.lifeline)",
    "DUPLEXQ_FAILPOINT": "fault injection in a worker (workers.failpoints, the tests)",
    "DUPLEXQ_FAILPOINT_MARKER": "the file a failpoint marks when it fires",
    "DUPLEXQ_NEMESIS_NO_HOSTS": "the nemesis tests without network namespaces",
    "DUPLEXQ_EXTRAS": "the Python extras scripts/setup installs",
    "DUPLEXQ_PYTHON": "the interpreter of bench/gpu.sh",
    "DUPLEXQ_GPU_BUDGET_S": "bench/gpu.sh's time budget",
    "DUPLEXQ_GPU_WHEELS": "bench/gpu.sh's wheel directory",
    "DUPLEXQ_MINICPMO_MODEL": "bench/gpu_media.sh's model",
    "DUPLEXQ_IMAGE": "docker-compose.yml: the CPU image",
    "DUPLEXQ_GPU_IMAGE": "docker-compose.yml: the GPU image",
    "DUPLEXQ_PYTHON_IMAGE": "docker-compose.yml: the images' base",
    "DUPLEXQ_REDIS_IMAGE": "docker-compose.yml: the Redis image",
    "DUPLEXQ_PROMETHEUS_IMAGE": "docker-compose.yml: the Prometheus image",
    "DUPLEXQ_MODELS": "docker-compose.yml: the host folder of models",
    "DUPLEXQ_REDIS_MAXMEMORY": "docker-compose.yml: Redis's memory limit",
    "DUPLEXQ_PUBLISH_ADDR": "docker-compose.yml: the address ports are published on",
    "DUPLEXQ_PUBLISH_PORT": "docker-compose.yml: the coordinator's published port",
    "DUPLEXQ_ECHO_PUBLISH_PORT": "docker-compose.yml: the echo coordinator's published port",
    "DUPLEXQ_PROMETHEUS_PORT": "docker-compose.yml: Prometheus's published port",
    "DUPLEXQ_COMPOSE_WORK": "scripts/compose-test's work folder",
    "DUPLEXQ_COMPOSE_KEEP_BASE": "scripts/compose-test keeps its base file system",
    "DUPLEXQ_COMPOSE_ROUNDS": "scripts/compose-test's kill-and-restart rounds",
    "DUPLEXQ_COMPOSE_ONLY": "scripts/compose-test's stacks to drive",
    "DUPLEXQ_COMPOSE_STORAGE_DRIVER": "scripts/compose-test's Docker storage driver",
}
"""``DUPLEXQ_*`` variables that are not settings, with what reads them: the scripts, the
compose file and the tests share the prefix, so a process must not refuse them."""


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """The ``DUPLEXQ_*`` names in ``environ`` that are neither a setting nor one of
    ``OTHER_VARIABLES``, each with the closest known name when one is close, e.g.
    ``DUPLEXQ_LEASE_TTL (did you mean DUPLEXQ_LEASE_TTL_MS?)``."""
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields} | set(OTHER_VARIABLES)
    found = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        found.append(f"{name} (did you mean {near[0]}?)" if near else name)
    return found


class StageConfig(_Model):
    """One stage of the pipeline and where its outputs go."""

    name: str = Field(pattern=_STAGE_NAME)
    """Stage name; also names its worker pool, streams and leases."""
    backend: Literal["echo", "vllm", "minicpmo", "mage_vl", "vad", "asr", "tts"] = "echo"
    """What does the work. ``echo`` is deterministic and for tests and benchmarks only."""
    input: str = SESSION_INPUT
    """``session`` to read the session's input log, or the name of an upstream stage."""
    to_client: bool = False
    """Whether this stage's outputs are journaled for the client."""
    capacity: int | None = Field(None, ge=1, le=100_000)
    """Sessions one worker of this stage owns at once (default: Settings.worker_capacity)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Backend options (model, engine arguments, voice, ...), checked by the backend."""


class PipelineConfig(_Model):
    """The stages of a pipeline, e.g. ``vad -> asr -> thinker -> tts -> client``."""

    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Pipeline name, shown in logs and replay reports."""
    stages: tuple[StageConfig, ...] = Field(min_length=1, max_length=32)
    """The stages; each reads the session log or one upstream stage."""

    @model_validator(mode="after")
    def _check_graph(self) -> Self:
        names = [stage.name for stage in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        if SESSION_INPUT in names:
            raise ValueError(f"{SESSION_INPUT!r} is reserved and cannot name a stage")
        known = set(names)
        for stage in self.stages:
            if stage.input != SESSION_INPUT and stage.input not in known:
                raise ValueError(f"stage {stage.name!r} reads unknown stage {stage.input!r}")
            if stage.input == stage.name:
                raise ValueError(f"stage {stage.name!r} cannot read its own outputs")
        for stage in self.stages:
            self._check_reaches_session(stage)
        if not any(stage.to_client for stage in self.stages):
            raise ValueError("at least one stage must send its outputs to the client")
        return self

    def _check_reaches_session(self, stage: StageConfig) -> None:
        seen: set[str] = set()
        current = stage
        while current.input != SESSION_INPUT:
            if current.name in seen:
                raise ValueError(f"stages form a cycle through {current.name!r}")
            seen.add(current.name)
            current = self.stage(current.input)

    def stage(self, name: str) -> StageConfig:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage named {name!r} in pipeline {self.name!r}")

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(stage.name for stage in self.stages)

    def downstream(self, name: str) -> tuple[str, ...]:
        """Stages that read ``name``'s outputs."""
        return tuple(stage.name for stage in self.stages if stage.input == name)

    def outputs_in_journal(self, name: str) -> bool:
        """True for a client-facing stage that no stage reads: its outputs are kept once,
        in the session's client journal, and its own stream holds only fence barriers
        (a takeover reads the stage's outputs back from the journal)."""
        return self.stage(name).to_client and not self.downstream(name)


class ConfigError(ValueError):
    """A configuration mistake, said in one line that names the file and the field."""


def problems(exc: ValidationError) -> str:
    """Every error of a pydantic validation as ``field: message``, joined into one line."""
    errors = exc.errors()
    seen: list[str] = []
    for err in errors:
        loc = err["loc"]
        # A tuple whose items failed also reports itself too short: the items say why.
        if err["type"] == "too_short" and any(
            len(other["loc"]) > len(loc) and other["loc"][: len(loc)] == loc for other in errors
        ):
            continue
        where = ".".join(str(part) for part in loc) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "literal_error":
            message = f"must be one of {err['ctx']['expected']}"
        elif err["type"] == "extra_forbidden":
            message = "unknown setting"
        line = f"{where}: {message}"
        if line not in seen:
            seen.append(line)
    return "; ".join(seen)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON file into a mapping (by extension); ConfigError if unreadable."""
    path = Path(path)
    if path.suffix not in (".json", ".toml"):
        raise ConfigError(f"config {path} must be .toml or .json")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ConfigError(f"config {path}: malformed {kind}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must hold a table at the top level")
    return data


def load_pipeline(path: str | Path) -> PipelineConfig:
    """The pipeline in ``path``; ConfigError naming the file and every bad field."""
    try:
        return PipelineConfig.model_validate(load_mapping(path))
    except ValidationError as exc:
        raise ConfigError(f"pipeline {path}: {problems(exc)}") from exc


def echo_pipeline(*names: str) -> PipelineConfig:
    """A chain of echo stages (``a -> b -> client``), for tests and benchmarks."""
    chain = names or ("echo",)
    if not all(re.match(_STAGE_NAME, name) for name in chain):
        raise ValueError(f"bad stage names {chain}")
    stages = [
        StageConfig(
            name=name,
            input=SESSION_INPUT if i == 0 else chain[i - 1],
            to_client=i == len(chain) - 1,
        )
        for i, name in enumerate(chain)
    ]
    return PipelineConfig(name="echo", stages=tuple(stages))
