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
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
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


class Settings(BaseSettings):
    """Process-wide settings shared by coordinators, workers and the control plane."""

    model_config = SettingsConfigDict(
        env_prefix="DUPLEXQ_", extra="forbid", frozen=True, use_attribute_docstrings=True
    )

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL; ``rediss://`` for TLS, ``redis://user:password@host`` for ACL users,
    ``redis+cluster://host:port[,host:port...]`` (one node or several) for a Redis Cluster
    (``docs/scaling.md``)."""
    control_redis_url: str = ""
    """The Redis of the control plane's job queue (arq); empty: ``redis_url``. arq is not
    cluster-aware: with a ``redis+cluster://`` data plane, give one plain Redis here."""
    redis_durability: Literal["required", "relaxed"] = "required"
    """What a process does at start when the data plane's Redis cannot keep an acknowledged
    input (``dataplane.redis_config`` reads its configuration): ``required`` refuses to
    start, in one line, when Redis runs without AOF, with ``appendfsync`` other than
    ``always``, with an evicting ``maxmemory-policy``, or on a cluster with a primary that
    has no replica; ``relaxed`` starts anyway and logs each of those as a warning (a Redis
    meant to forget: benchmarks, a throwaway test). Warnings that threaten no
    acknowledged input are logged either way (docs/deploy.md, "Redis checks at start")."""
    key_prefix: str = Field("dq", pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    """Prefix of every key; lets several deployments (or tests) share one Redis."""
    lease_ttl_ms: int = Field(3000, ge=200, le=120_000)
    """How long a worker's ownership of (session, stage) lasts without a heartbeat."""
    heartbeat_ms: int = Field(750, ge=50, le=60_000)
    """How often a worker renews its leases; keep it at most a third of the TTL."""
    block_ms: int = Field(500, ge=10, le=30_000)
    """Longest a blocking stream read waits before the loop looks around again."""
    sweep_ms: int = Field(1000, ge=10, le=600_000)
    """How often a reader reads every stream it follows without waiting for a ring
    (``dataplane.bells``): the bound on the delay a lost ring can cause."""
    linger_ms: float = Field(1.0, ge=0, le=100)
    """Linger of the data plane's loops (``dataplane.pacing``): while rounds are filling
    up (the last one carried several items), a read or a batch of script calls that
    would follow the previous one by less than this waits out the rest, so the work
    arriving meanwhile joins it: fewer, fuller rounds for at most this much delay per
    hop (section 11 of docs/benchmarks.md measures it). A lone caller and a quiet loop
    are never delayed. 0 turns it off."""
    append_batch: int = Field(0, ge=0, le=256)
    """0 (shipped): a coordinator sends the script calls of one turn of its event loop (the
    clients' appends, mostly) to Redis together, so that one fsync of Redis's AOF covers
    all of them. N: it sends them as soon as N are waiting, instead of at the end of the
    turn: Redis runs one batch while the coordinator builds the next, which helps a Redis
    without persistence but makes each batch wait for an fsync of its own on the shipped
    one (docs/scaling.md, "What the shipped persistence costs"). Workers always send a
    turn's publishes together."""
    read_batch: int = Field(64, ge=1, le=10_000)
    """Most entries one stream read returns; a stage catching up gets batches this big."""
    coalesce_ms: int = Field(20, ge=0, le=1000)
    """Coalescing window of a streaming answer: after its first output, which goes out at
    once, a stage publishes its streamed outputs at most once per this many ms, each
    publish carrying every output staged meanwhile (each still its own delta). A draft
    waits at most this long; 0 publishes every streamed output at once."""
    coalesce_max: int = Field(16, ge=1, le=1024)
    """Streamed outputs a stage holds back at most before it publishes them, window or
    not (a model streaming faster than this per window is published in batches this big)."""
    worker_capacity: int = Field(64, ge=1, le=100_000)
    """Most sessions one worker owns at once; it takes no new work when full."""
    max_session_failures: int = Field(3, ge=1, le=1000)
    """A session on which a stage fails this many times in a row (its state cannot be
    rebuilt, or applying its next input keeps failing, on any worker) is closed with a
    ``session_failed`` error to its client instead of moving between workers for ever."""
    orphan_scan_ms: int = Field(250, ge=20, le=60_000)
    """How often a worker with spare capacity looks for expired leases to take over."""
    assign_claim_idle_ms: int = Field(5000, ge=100, le=600_000)
    """An assignment entry pending this long (its reader died) is claimed by another."""
    input_retention: int = Field(100_000, ge=100)
    """Entries kept in a session's input log; never trimmed past unapplied entries."""
    output_retention: int = Field(100_000, ge=100)
    """Entries kept in each output stream of a session (the resume journal included)."""
    retention_s: int = Field(0, ge=0, le=365 * 86400)
    """Entries older than this many seconds are trimmed from a session's input log, its
    stage streams and its journal too, whatever the counts above allow (never an entry
    a stage has not applied yet). 0: only the counts bound the streams. The log is what
    failover and replay read: keep it at least as long as a session may need either."""
    closed_ttl_s: int = Field(3600, ge=1, le=30 * 86400)
    """Seconds a closed session's keys are kept (for replay and late readers)."""
    max_sessions: int = Field(10_000, ge=1)
    """Most client connections one coordinator process serves at once (a bound on its
    memory); beyond it a new connection gets ``resource_exhausted``."""
    max_sessions_per_key: int = Field(1000, ge=1)
    """Most live sessions one API key holds across every coordinator: attached ones and
    detached ones still within their resume grace. Sessions opened with a client secret
    count against the key that minted it; anonymous sessions share one count. Beyond it
    opening a session gets ``session_limit`` and the socket is closed with 1013."""
    max_sessions_total: int = Field(100_000, ge=1)
    """Most live sessions of the whole deployment, counted as ``max_sessions_per_key``
    counts them; beyond it opening a session gets ``session_limit``."""
    host: str = "127.0.0.1"
    """Address the coordinator's HTTP/WebSocket server binds."""
    port: int = Field(8080, ge=0, le=65535)
    """Port of the coordinator's HTTP/WebSocket server (0: any free port)."""
    pipeline: str = ""
    """Pipeline file (.toml/.json) every command serves unless given ``--pipeline``;
    empty: the shipped ``configs/default.toml``."""
    models_dir: str = Field("var/models", min_length=1)
    """Where prepared models live: ``package:NAME`` models and the tiny fallback model
    (``docs/models.md``). ``duplexq up`` uses ``<workdir>/models``."""
    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    """Accepted API keys (``Authorization: Bearer`` or the WebSocket subprotocol
    ``openai-insecure-api-key.<key>``); comma-separated in ``DUPLEXQ_API_KEYS``. Never
    accepted in a URL."""
    allow_anonymous: bool = False
    """Serve clients without an API key. Off unless explicitly enabled."""
    client_secret_ttl_s: int = Field(600, ge=10, le=7200)
    """Lifetime of a client secret (``POST /v1/realtime/client_secrets``) whose request
    names none; a request may ask for 10 to 7200 seconds."""
    max_event_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    """Largest client event accepted; bigger ones get ``event_too_large``."""
    max_pending_input_bytes: int = Field(8 << 20, ge=1024)
    """Input bytes a connection may have sent that its session's first stages have not
    applied yet; beyond it events get ``input_backpressure`` (cancels and barge-ins are
    counted but never refused: control goes before data). Every event counts: an append
    its payload's size, at least ``min_event_cost_bytes``."""
    min_event_cost_bytes: int = Field(256, ge=1, le=1 << 20)
    """What one client event costs at least against ``max_pending_input_bytes``: a
    commit, clear, ack, cancel or ``session.update`` carries no input bytes yet costs a
    Redis write and a stage's work."""
    max_events_per_s: float = Field(200.0, gt=0, le=100_000)
    """Client events one connection may send per second, sustained (a token bucket
    refilled at this rate). An event beyond it is refused with ``rate_limited``; the
    connection goes on."""
    event_burst: int = Field(400, ge=1, le=1_000_000)
    """Client events one connection may send at once above ``max_events_per_s`` (the
    token bucket's size)."""
    max_outbound_events: int = Field(4096, ge=16, le=1_000_000)
    """Server events queued for one connection's socket at most (at least 4 x
    ``read_batch``). A client that stops reading fills it and is disconnected with close
    code 4008; its session stays resumable and nothing accepted is lost (the journal
    holds it)."""
    client_send_timeout_ms: int = Field(5000, ge=50, le=600_000)
    """How long one server event may wait for the client's socket to take it. A client
    that does not read for that long is closed with 4008 (``coordinator.socket_io``);
    its session stays resumable."""
    client_close_wait_ms: int = Field(10_000, ge=50, le=600_000)
    """How long the 4008 close of a client that stopped reading may wait for the
    client; then its connection is dropped (the TCP connection aborted)."""
    journaled_error_burst: int = Field(32, ge=1, le=100_000)
    """Errors answering a connection's refused events that are written to the session's
    journal at once (and so replayed on a resume); refilled at
    ``journaled_errors_per_s``. Errors beyond it go to the socket only."""
    journaled_errors_per_s: float = Field(1.0, gt=0, le=10_000)
    """The rate at which a connection's journaled-error allowance refills."""
    resume_grace_s: int = Field(60, ge=0, le=86_400)
    """How long a session without a connection is kept for ``session.resume``."""
    attach_ttl_ms: int = Field(5000, ge=300, le=600_000)
    """How long a client connection's hold on its session lasts unrenewed; its
    coordinator renews it every third of this. When a coordinator dies, its
    sessions count as detached (the resume grace starts) this long after."""
    first_event_wait_ms: int = Field(300, ge=0, le=10_000)
    """How long a new connection waits for a ``session.resume`` before opening a session."""

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

    @field_validator("api_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):  # DUPLEXQ_API_KEYS
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

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
