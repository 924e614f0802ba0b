"""Sizes and durations of every benchmark, for the full run and the quick smoke run.

The full run is sized for a 2-core machine to finish in well under 15
minutes; the quick run checks that everything works end to end in about two.
Every figure in the report names the plan it was measured under.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SECTIONS = ("raw", "latency", "throughput", "bargein", "failover", "backlog", "scaling", "takein",
            "primaries", "linger", "coalesce", "voice")  # fmt: skip
"""Every section of ``python -m bench``, in the order they run and are reported."""


@dataclass(frozen=True)
class Plan:
    name: str
    raw_rtt_samples: int
    """Round trips measured one at a time (after 200 warm-up ones)."""
    raw_stream_events: int
    """Messages of the batched raw stream (the unbatched one sends a quarter)."""
    redis_benchmark_requests: int
    """XADDs of redis-benchmark's pipelined run (the single-client run sends a tenth)."""
    latency_sessions: tuple[int, ...]
    """Concurrent sessions of the per-hop latency benchmark, 25 chunks/s each."""
    latency_seconds: float
    """Measured seconds per session count (after ``warmup_seconds``)."""
    warmup_seconds: float
    throughput_workers: tuple[int, ...]
    """Echo worker processes of the throughput benchmark."""
    throughput_seconds: float
    throughput_sessions: int
    throughput_window: int
    """Most events in flight (sent, not yet delivered) while driving to saturation."""
    bargein_trials: int
    bargein_vllm_trials: int
    """0 skips the vLLM part."""
    failover_ttls_ms: tuple[int, ...]
    failover_sessions: int
    backlog_events: int
    backlog_sessions: int
    """The backlog is spread over this many sessions; the first one is then replayed."""
    scaling_workers: tuple[int, ...]
    scaling_sessions: tuple[int, ...]
    """Session counts tried in order for each worker count, until the budget is missed."""
    scaling_seconds: float
    budget_ms: float
    """Latency budget of the scaling curve: p99 added over the raw round trip."""
    takein_sessions: tuple[int, ...] = (100, 1000, 5000)
    """Waiting sessions one new worker takes in, per point."""
    linger_sessions: tuple[int, ...] = (50, 100, 150)
    """Paced session counts measured with the linger off and at its shipped value."""
    linger_repeats: int = 2
    """Times each setting is measured per session count, alternating with the other."""
    latency_repeats: int = 5
    """Runs of each served latency point; the point shown is the run with the median added
    p99, every run's added p99 kept beside it (one stall of the machine moves one run; on
    this noisy 2-core machine 3 runs ranged over 3x, so the median is of 5)."""
    throughput_pairs: int = 5
    """Side-by-side pairs of the one-worker saturation point and the raw batched stream,
    each saturation run bracketed by raw runs just before and just after it (the mean of
    the two is its reference); the ratio reported is the median pair's."""
    scaleout_sessions_per_worker: int = 40
    """Paced sessions each worker serves when workers are added with their sessions
    (``bench.scaleout``), for each worker count of ``throughput_workers``."""

    coalesce_answers: int = 10
    """Answers of 50 streamed tokens each session streams per setting (``bench.coalesce``)."""
    coalesce_repeats: int = 3
    """Runs of each coalescing setting; the figures are their medians."""
    voice_turns: int = 20
    """Spoken questions of the voice-to-voice benchmark (``bench.voice``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FULL = Plan(
    name="full",
    raw_rtt_samples=3000,
    raw_stream_events=40_000,
    redis_benchmark_requests=200_000,
    latency_sessions=(1, 100, 200, 1000),
    latency_seconds=10.0,
    warmup_seconds=2.0,
    throughput_workers=(1, 2, 4),
    throughput_seconds=8.0,
    throughput_sessions=64,
    throughput_window=512,
    bargein_trials=20,
    bargein_vllm_trials=5,
    failover_ttls_ms=(1000, 2000, 5000),
    failover_sessions=8,
    backlog_events=100_000,
    backlog_sessions=10,
    scaling_workers=(1, 2, 4),
    scaling_sessions=(5, 10, 20, 40, 80, 160, 320, 640),
    scaling_seconds=5.0,
    budget_ms=20.0,
)

QUICK = Plan(
    name="quick",
    raw_rtt_samples=500,
    raw_stream_events=8000,
    redis_benchmark_requests=40_000,
    latency_sessions=(1, 100),
    latency_seconds=3.0,
    warmup_seconds=1.0,
    throughput_workers=(1, 2),
    throughput_seconds=3.0,
    throughput_sessions=32,
    throughput_window=256,
    bargein_trials=5,
    bargein_vllm_trials=0,
    failover_ttls_ms=(1000,),
    failover_sessions=4,
    backlog_events=10_000,
    backlog_sessions=10,
    scaling_workers=(1, 2),
    scaling_sessions=(5, 20),
    scaling_seconds=2.0,
    budget_ms=20.0,
    takein_sessions=(100, 1000),
    linger_sessions=(50,),
    linger_repeats=1,
    latency_repeats=1,
    throughput_pairs=1,
    scaleout_sessions_per_worker=20,
    coalesce_answers=4,
    coalesce_repeats=1,
    voice_turns=3,
)
