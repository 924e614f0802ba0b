"""The Prometheus metrics of every duplexq process, on ``prometheus_client``.

Each process exposes its own: the coordinator at ``/metrics`` of its HTTP server,
workers on ``--metrics-port`` (``serve_metrics``). They live in
``prometheus_client``'s default registry, beside its process and platform metrics
(and vLLM's own, in a thinker worker). Counters that must add up across processes
(stale drops, failovers) are also mirrored into the shared ``dq:metrics`` hash by
the code that counts them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import REGISTRY, Counter, Gauge, Histogram

# No ``*_created`` series: a scrape carries the values and nothing else per metric.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TURN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0)
"""From a turn's end to its answer: a model's first token, seconds on a CPU."""

DROPPED_STALE = Counter(
    "duplexq_dropped_stale_total",
    "Messages dropped because their fence regressed, by reason.",
    ["stage", "reason"],
)
EVENTS_IN = Counter("duplexq_events_in_total", "Events a stage consumed.", ["stage"])
EVENTS_OUT = Counter("duplexq_events_out_total", "Outputs a stage published.", ["stage"])
PUBLISHES = Counter(
    "duplexq_publish_calls_total",
    "Atomic publish steps (a batch of outputs plus progress).",
    ["stage"],
)
FAILOVERS = Counter("duplexq_failovers_total", "Sessions a worker took over.", ["stage"])
OWNED_SESSIONS = Gauge("duplexq_owned_sessions", "Sessions a worker owns now.", ["stage"])
STAGE_PENDING = Gauge(
    "duplexq_stage_pending_entries",
    "Entries a worker has read but not applied yet, per stage.",
    ["stage"],
)
STAGE_LAG = Gauge(
    "duplexq_stage_lag_seconds",
    "Age of the oldest entry a worker has not applied, per stage.",
    ["stage"],
)
BARGE_IN_REACTION = Histogram(
    "duplexq_barge_in_reaction_seconds",
    "From a cancel being written to a worker stopping the cancelled work.",
    ["stage"],
    buckets=LATENCY_BUCKETS,
)
CANCEL_ACK = Histogram(
    "duplexq_cancel_ack_seconds",
    "From a client's cancel reaching the coordinator to its acknowledgement.",
    buckets=LATENCY_BUCKETS,
)
FIRST_OUTPUT = Histogram(
    "duplexq_time_to_first_output_seconds",
    "From the end of the user's turn (a typed commit, or the server VAD's turn end "
    "reaching the coordinator) to the first output of the answer sent to the client.",
    ["turn"],
    buckets=TURN_BUCKETS,
)
SESSIONS = Gauge("duplexq_sessions", "Sessions with a live client connection.")
UNREPLICATED_WRITES = Counter(
    "duplexq_unreplicated_writes_total",
    "Scripts a Redis Cluster primary acknowledged with no replica attached.",
)
COALESCE_DELAY = Histogram(
    "duplexq_coalesce_delay_seconds",
    "How long a streamed output was held back to be published with the next ones.",
    ["stage"],
    buckets=LATENCY_BUCKETS,
)
REDIS_CONFIG_FINDINGS = Gauge(
    "duplexq_redis_config_findings",
    "What the start-up check of the data plane's Redis found (dataplane.redis_config), "
    "by setting and severity; an error here means redis_durability is relaxed.",
    ["setting", "severity"],
)


def exposition() -> tuple[bytes, str]:
    """This process's metrics in the text format, and its content type."""
    return prometheus_client.generate_latest(REGISTRY), prometheus_client.CONTENT_TYPE_LATEST


def value(name: str, **labels: str) -> float:
    """The sum of this process's samples named ``name`` whose labels include ``labels``
    (0 when there is none)."""
    wanted = labels.items()
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.name == name and wanted <= sample.labels.items()
    )


@dataclass
class MetricsServer:
    """``prometheus_client``'s HTTP server for ``/metrics``, on a thread of its own."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def serve_metrics(host: str, port: int) -> MetricsServer:
    """Serve this process's metrics on ``host:port`` (workers; OSError if it is taken)."""
    server, thread = prometheus_client.start_http_server(port, addr=host)
    return MetricsServer(server, thread)
