"""In-process metrics with Prometheus text exposition.

Counters, gauges and histograms with labels, in one registry per process.
Counters that must add up across processes (stale drops, failovers) are also
mirrored into the shared ``dq:metrics`` hash by the code that counts them.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from collections.abc import Sequence
from typing import TypeVar

LabelKey = tuple[tuple[str, str], ...]
_M = TypeVar("_M", bound="Metric")


def _key(labels: dict[str, str]) -> LabelKey:
    return tuple(sorted(labels.items()))


def _render_labels(key: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = key + extra
    if not items:
        return ""
    body = ",".join(f'{k}="{v}"' for k, v in items)
    return "{" + body + "}"


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text
        self._lock = threading.Lock()

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.values: dict[LabelKey, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = _key(labels)
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(_key(labels), 0.0)

    def render(self) -> list[str]:
        lines = super().render()
        lines += [f"{self.name}{_render_labels(k)} {v}" for k, v in sorted(self.values.items())]
        return lines


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self.values[_key(labels)] = value


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self.counts: dict[LabelKey, list[int]] = {}
        self.sums: dict[LabelKey, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = _key(labels)
        with self._lock:
            counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sums[key] = self.sums.get(key, 0.0) + value

    def render(self) -> list[str]:
        lines = super().render()
        for key, counts in sorted(self.counts.items()):
            running = 0
            for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                running += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f"{self.name}_bucket{_render_labels(key, (('le', le),))} {running}")
            lines.append(f"{self.name}_sum{_render_labels(key)} {self.sums[key]}")
            lines.append(f"{self.name}_count{_render_labels(key)} {running}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def counter(self, name: str, help_text: str) -> Counter:
        return self._add(Counter(name, help_text))

    def gauge(self, name: str, help_text: str) -> Gauge:
        return self._add(Gauge(name, help_text))

    def histogram(self, name: str, help_text: str, buckets: Sequence[float]) -> Histogram:
        return self._add(Histogram(name, help_text, buckets))

    def _add(self, metric: _M) -> _M:
        existing = self._metrics.get(metric.name)
        if existing is not None:
            if type(existing) is not type(metric):
                raise ValueError(f"metric {metric.name} already registered as {existing.kind}")
            return existing
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


REGISTRY = Registry()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

DROPPED_STALE = REGISTRY.counter(
    "duplexq_dropped_stale_total", "Messages dropped because their fence regressed, by reason."
)
EVENTS_IN = REGISTRY.counter("duplexq_events_in_total", "Events a stage consumed.")
EVENTS_OUT = REGISTRY.counter("duplexq_events_out_total", "Outputs a stage published.")
PUBLISHES = REGISTRY.counter(
    "duplexq_publish_calls_total", "Atomic publish steps (a batch of outputs plus progress)."
)
FAILOVERS = REGISTRY.counter("duplexq_failovers_total", "Sessions a worker took over.")
OWNED_SESSIONS = REGISTRY.gauge("duplexq_owned_sessions", "Sessions a worker owns now.")
STAGE_PENDING = REGISTRY.gauge(
    "duplexq_stage_pending_entries", "Entries a worker has read but not applied yet, per stage."
)
STAGE_LAG = REGISTRY.gauge(
    "duplexq_stage_lag_seconds", "Age of the oldest entry a worker has not applied, per stage."
)
BARGE_IN_REACTION = REGISTRY.histogram(
    "duplexq_barge_in_reaction_seconds",
    "From a cancel being written to a worker stopping the cancelled work.",
    LATENCY_BUCKETS,
)
CANCEL_ACK = REGISTRY.histogram(
    "duplexq_cancel_ack_seconds",
    "From a client's cancel reaching the coordinator to its acknowledgement.",
    LATENCY_BUCKETS,
)
FIRST_OUTPUT = REGISTRY.histogram(
    "duplexq_time_to_first_output_seconds",
    "From the end of the user's turn to the first response output sent to the client.",
    LATENCY_BUCKETS,
)
SESSIONS = REGISTRY.gauge("duplexq_sessions", "Sessions with a live client connection.")


async def serve_metrics(host: str, port: int) -> asyncio.AbstractServer:
    """A minimal HTTP endpoint serving ``/metrics`` (workers and the control plane)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            ok = request.split(b" ")[1:2] == [b"/metrics"]
            body = REGISTRY.render().encode() if ok else b"not found\n"
            status = b"200 OK" if ok else b"404 Not Found"
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                b"Content-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


UNREPLICATED_WRITES = REGISTRY.counter(
    "duplexq_unreplicated_writes_total",
    "Scripts a Redis Cluster primary acknowledged with no replica attached.",
)
