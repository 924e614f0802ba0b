"""The sections of ``schemas.config.Settings``: its fields grouped by what they govern.

``Settings`` inherits every section, so a field is still ``settings.<name>`` and is set
by ``DUPLEXQ_<NAME>`` as before; a section only says where a field belongs
(``schemas.config.SECTIONS`` lists them, taken from ``Settings``'s bases). A field added
to ``Settings`` goes in the section of its concern (``tests/test_config.py`` checks that
every field belongs to exactly one).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import NoDecode


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)


class RedisSettings(_Section):
    """Where the data plane's Redis is and what it must guarantee."""

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


class OwnershipSettings(_Section):
    """How workers hold sessions: leases, capacity, takeover, failures."""

    lease_ttl_ms: int = Field(3000, ge=200, le=120_000)
    """How long a worker's ownership of (session, stage) lasts without a heartbeat."""
    heartbeat_ms: int = Field(750, ge=50, le=60_000)
    """How often a worker renews its leases; keep it at most a third of the TTL."""
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


class DataPlaneSettings(_Section):
    """How the data plane's loops read and write: blocking, sweeps, linger, batches."""

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


class RetentionSettings(_Section):
    """How long sessions' streams and closed sessions are kept."""

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


class ServerSettings(_Section):
    """What a process serves and from where: address, pipeline, models."""

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


class AccessSettings(_Section):
    """Who may connect: API keys, anonymous clients, client secrets."""

    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    """Accepted API keys (``Authorization: Bearer`` or the WebSocket subprotocol
    ``openai-insecure-api-key.<key>``); comma-separated in ``DUPLEXQ_API_KEYS``. Never
    accepted in a URL."""
    allow_anonymous: bool = False
    """Serve clients without an API key. Off unless explicitly enabled."""
    client_secret_ttl_s: int = Field(600, ge=10, le=7200)
    """Lifetime of a client secret (``POST /v1/realtime/client_secrets``) whose request
    names none; a request may ask for 10 to 7200 seconds."""

    @field_validator("api_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):  # DUPLEXQ_API_KEYS
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value


class ClientLimitSettings(_Section):
    """What one client, one API key and the deployment may use at most."""

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


class ResumeSettings(_Section):
    """How a session outlives its connection: attachment, resume grace."""

    resume_grace_s: int = Field(60, ge=0, le=86_400)
    """How long a session without a connection is kept for ``session.resume``."""
    attach_ttl_ms: int = Field(5000, ge=300, le=600_000)
    """How long a client connection's hold on its session lasts unrenewed; its
    coordinator renews it every third of this. When a coordinator dies, its
    sessions count as detached (the resume grace starts) this long after."""
    first_event_wait_ms: int = Field(300, ge=0, le=10_000)
    """How long a new connection waits for a ``session.resume`` before opening a session."""
