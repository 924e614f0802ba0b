"""``duplexq replay``: the command line of a replay, and the note under its verdict.

The replay itself is ``coordinator.controlplane.replay``; its comparison
``coordinator.controlplane.replay_verdict``.
The note under a DIFFERENT verdict speaks of the record that decided it (its stage):
sampling only when that stage is a sampling model stage and the replay was not greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from coordinator.controlplane.replay import (
    ProgressPrinter,
    ReplayReport,
    replay_greedily,
    replay_session,
)
from dataplane.bus import RedisBus
from schemas.config import PipelineConfig
from schemas.errors import DuplexqError
from schemas.keys import Keys


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``duplexq replay SOURCE TARGET [--pace fast|recorded] [--speed X]
    [--greedy [--again ID]] ...``."""
    from coordinator.launcher.control_cli import add_common_options

    parser = subparsers.add_parser(
        "replay", help="replay a session's input log into a new session and compare outputs"
    )
    add_common_options(parser)
    parser.add_argument("source", help="recorded session id")
    parser.add_argument("target", help="new session id to replay into")
    parser.add_argument("--pace", choices=("fast", "recorded"), default="fast")
    parser.add_argument("--speed", type=float, default=1.0, help="recorded pace divided by this")
    parser.add_argument("--timeout", type=float, default=120.0, help="longest wait for outputs (s)")
    parser.add_argument("--keep-open", action="store_true", help="leave the target session open")
    parser.add_argument(
        "--greedy", action="store_true",
        help="model stages decode greedily (temperature 0); a sampled source is then "
        "replayed twice and the two replays are compared",
    )  # fmt: skip
    parser.add_argument(
        "--again", metavar="ID", help="second target of a --greedy replay (default TARGET.again)"
    )
    parser.add_argument(
        "--enqueue", action="store_true", help="hand it to the control plane instead (arq job)"
    )
    parser.set_defaults(func=replay_command)


MODEL_BACKENDS = frozenset({"vllm", "minicpmo", "mage_vl"})


def sampled_stages(pipeline: PipelineConfig) -> list[str]:
    """Model stages whose answers vary from run to run: sampling (temperature above 0)
    with no fixed seed. Their replays differ even when nothing else does."""
    found = []
    for stage in pipeline.stages:
        if stage.backend not in MODEL_BACKENDS:
            continue
        temperature = float(stage.options.get("temperature", 0.7))
        if temperature > 0 and stage.options.get("seed") is None:
            found.append(f"{stage.name} (temperature {temperature:g}, no seed)")
    return found


def sampling_hint(pipeline: PipelineConfig) -> str | None:
    """Why a replay of ``pipeline`` may differ although nothing is wrong, if it may."""
    sampled = sampled_stages(pipeline)
    if not sampled:
        return None
    return (
        f"  note: {', '.join(sampled)} samples its answers, so they differ from run to run; "
        "replay with --greedy to check that the pipeline reproduces itself, or serve it "
        "greedily (temperature = 0) or with a fixed seed (see docs/models.md)"
    )


GREEDY_HINT = (
    "  note: two greedy replays differ: a stage answers differently to the same inputs "
    "even greedily (a backend that does not decode greedily, a seedless random choice, "
    "or numerics that vary with the batch)"
)


def replay_hint(report: ReplayReport, pipeline: PipelineConfig) -> str | None:
    """What to say under a DIFFERENT verdict, about the record that decided it: sampling
    only when that record is a sampling model stage's and the replay was not greedy."""
    if report.identical:
        return None
    deciding = report if report.again is None else report.again
    mismatch = deciding.comparison.first_mismatch
    if mismatch is None:
        return (
            "  note: every output the target gave is equal, but it had not given them all "
            "when the wait ended (raise --timeout on a slow machine)"
        )
    stage = next((s for s in pipeline.stages if s.name == mismatch.stage), None)
    sampled = stage is not None and any(
        found.startswith(f"{stage.name} (") for found in sampled_stages(pipeline)
    )
    if sampled and not report.greedy:
        return sampling_hint(pipeline)
    if stage is not None and stage.backend in MODEL_BACKENDS and report.greedy:
        return f"{GREEDY_HINT}; here the model stage {stage.name}"
    return (
        f"  note: the first difference is stage {mismatch.stage}'s, which does not sample: "
        "it heard other inputs or at other times (a cancel or barge-in the source received "
        "is not replayed), or it answers differently to the same ones"
    )


def replay_command(args: argparse.Namespace) -> int:
    """Run (or enqueue) a replay; exit 0 when the outputs are identical, 1 when
    they differ, 2 when the replay could not run."""
    from coordinator.launcher.stack_state import settings_for
    from dataplane.config import load_pipeline_for
    from dataplane.redis_config import check_at_start

    if args.again and not args.greedy:
        print("duplexq replay: error: --again names the second target of a --greedy replay",
              file=sys.stderr)  # fmt: skip
        return 2
    settings = settings_for(args, "replay")
    pipeline = load_pipeline_for(settings, args.pipeline)
    # A replay writes a session: not into a Redis that cannot keep it (RedisRefused).
    asyncio.run(check_at_start(settings))
    if args.enqueue:
        from coordinator.controlplane.control import enqueue_replay

        queued = asyncio.run(
            enqueue_replay(
                settings, args.source, args.target, pace=args.pace, speed=args.speed,
                pipeline=pipeline if args.pipeline else None, greedy=args.greedy,
                again=args.again,
            )
        )  # fmt: skip
        print("replay queued" if queued else "replay already requested")
        return 0

    async def run() -> ReplayReport:
        bus = RedisBus(settings.redis_url, Keys(settings.key_prefix))
        options: dict[str, Any] = dict(
            pace=args.pace, speed=args.speed, progress=ProgressPrinter(),
            wait_timeout_s=args.timeout, close_target=not args.keep_open,
            closed_ttl_s=settings.closed_ttl_s,
        )  # fmt: skip
        try:
            if args.greedy:
                return await replay_greedily(
                    bus, pipeline, args.source, args.target, again=args.again, **options
                )
            return await replay_session(bus, pipeline, args.source, args.target, **options)
        finally:
            await bus.aclose()

    try:
        report = asyncio.run(run())
    except DuplexqError as exc:
        print(f"replay failed: {exc.message}", file=sys.stderr)
        return 2
    print(report.summary())
    if (hint := replay_hint(report, pipeline)) is not None:
        print(hint)
    return 0 if report.identical else 1
