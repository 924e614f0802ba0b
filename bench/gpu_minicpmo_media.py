"""Check on a GPU that MiniCPM-o's processor expands each unit to the stage's budget.

    python -m bench.gpu_minicpmo_media --model /models/MiniCPM-o-4_5
    bench/gpu_media.sh                      # the same, picking Python and limits

The ``minicpmo`` stage fits its duplex prompt by token budgets
(``workers/extensions/budget.py``: 12 tokens per whole second of audio, 66
per image block, a base frame sliced MiniCPM-V's way). It sends each unit as
one marker per item and the unit's media as ``multi_modal_data``; vLLM's
processor for the checkpoint expands the markers. This script drives the
stage itself (no Redis: ``handle`` called directly) over the real checkpoint
with units whose budgets differ (whole and partial seconds of audio, one
frame, a sliced stacked pair, audio with a frame) and records what
``AsyncLLM.generate`` received and returned. For each unit's request it
compares the prompt vLLM expanded with the prompt the stage accounted for;
from how much each grew it derives the tokens the checkpoint's processor
gave that unit (``model``). A unit whose count differs from its budget, or
a request vLLM refuses, is a failure, and the report names the unit.

Prints a table, writes ``bench/gpu-minicpmo-media.json``; exit status 0 when
every unit matches, 1 when one does not, 2 when the engine cannot start.
``--audio-marker "<unk>" --context-reserve 0`` with ``--audio-only`` runs the
same checks against the tiny Qwen2-Audio of ``tests/tiny_audio_lm.py`` on
CPU, which only shows the script works.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from schemas.events import AudioPayload, InputEvent, InputMode, UnitPayload, VideoPayload
from schemas.fence import Fence
from workers.backends.base import StageContext
from workers.extensions.budget import audio_token_budget, video_token_budget

RESULTS = Path(__file__).with_name("gpu-minicpmo-media.json")
RATE = 16_000


def _png(size: tuple[int, int], seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _audio(seconds: float, seed: int) -> AudioPayload:
    samples = np.random.default_rng(seed).uniform(-0.3, 0.3, int(seconds * RATE))
    return AudioPayload(samples.astype("<f4").tobytes())


def units(audio_only: bool) -> list[tuple[str, UnitPayload]]:
    """The units fed, each named by what its budget exercises."""
    chosen = [
        ("1 s audio", UnitPayload(audio=_audio(1.0, 1))),
        ("2 s audio", UnitPayload(audio=_audio(2.0, 2))),
        ("0.64 s audio", UnitPayload(audio=_audio(0.64, 3))),
        ("2.5 s audio", UnitPayload(audio=_audio(2.5, 4))),
    ]
    if not audio_only:
        chosen += [
            ("one 448x448 frame", UnitPayload(video=VideoPayload((_png((448, 448), 5),)))),
            (
                "pair, 896x448 base (sliced) + follower",
                UnitPayload(video=VideoPayload((_png((896, 448), 6), _png((448, 448), 7)))),
            ),
            (
                "1 s audio + 640x480 frame",
                UnitPayload(audio=_audio(1.0, 8), video=VideoPayload((_png((640, 480), 9),))),
            ),
        ]
    return chosen


def budget(payload: UnitPayload) -> int:
    audio = 0 if payload.audio is None else audio_token_budget(payload.audio.data)
    video = 0 if payload.video is None else video_token_budget(payload.video.frames)
    return audio + video


class Recorder:
    """Wraps ``AsyncLLM.generate``: keeps each request's prompt and latest output."""

    def __init__(self, llm: Any) -> None:
        self.requests: dict[str, tuple[dict[str, Any], Any]] = {}
        self._generate = llm.generate

    async def generate(
        self, prompt: Any, params: Any, request_id: str, *args: Any, **kw: Any
    ) -> AsyncIterator[Any]:
        self.requests[request_id] = (prompt, None)
        async for output in self._generate(prompt, params, request_id, *args, **kw):
            self.requests[request_id] = (prompt, output)
            yield output


async def run(args: argparse.Namespace) -> int:
    from workers.backends.minicpmo_engine import MiniCPMOEngine
    from workers.backends.minicpmo_options import parse_minicpmo_options
    from workers.backends.minicpmo_stage import MiniCPMOStage

    options: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "trust_remote_code": True,
        "max_model_len": args.max_model_len,
        "max_tokens": 2,
        "temperature": 0.0,
        "seed": 0,
        "context_reserve": args.context_reserve,
        "limit_mm_per_prompt": {"audio": 16, "image": 16},
        "send_media": True,
    }
    if args.audio_marker:
        options["audio_marker"] = args.audio_marker
    if args.kv_cache_memory_bytes:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    engine = MiniCPMOEngine(parse_minicpmo_options("thinker", options))
    started = time.monotonic()
    try:
        llm = await engine.ready()
    except Exception as exc:
        print(f"gpu_minicpmo_media: the engine did not start: {exc!r}", file=sys.stderr)
        return 2
    print(f"engine started in {time.monotonic() - started:.0f} s")
    recorder = Recorder(llm)
    wrapped: Any = llm  # the engine's generate is replaced by the recording one
    wrapped.generate = recorder.generate
    stage = MiniCPMOStage(options, stage="thinker", engine=engine)
    ctx = StageContext("media-check", "thinker", Fence("media-check", 0, 0), options)
    await stage.start(ctx, [], [])
    rows: list[dict[str, Any]] = []
    before = (0, 0)  # the previous request's accounted and expanded prompt lengths
    try:
        for seq, (name, payload) in enumerate(units(args.audio_only), 1):
            row = await _check_unit(stage, recorder, ctx, seq, name, payload, before)
            rows.append(row)
            before = (row.get("accounted_tokens", 0), row.get("expanded_tokens", 0))
    finally:
        await stage.stop(ctx)
        await engine.shutdown()
    return _report(rows, args)


async def _check_unit(
    stage: Any,
    recorder: Recorder,
    ctx: StageContext,
    seq: int,
    name: str,
    payload: UnitPayload,
    before: tuple[int, int],
) -> dict[str, Any]:
    """One unit's request; ``model_tokens`` is what the engine made of this unit alone.

    Each request's prompt is the previous one, the previous unit's answer and
    this unit, in the stage's accounting and in vLLM's expansion alike, so
    the growth of the two differs by exactly what this unit's expansion
    differs from its budget.
    """
    row: dict[str, Any] = {"unit": name, "budget": budget(payload)}
    event = InputEvent(ctx.fence, seq, seq, InputMode.APPEND_UNIT, payload)
    try:
        async for _ in stage.handle(ctx, event):
            pass
    except Exception as exc:
        row.update(ok=False, error=repr(exc)[:400])
        return row
    record = list(stage.records.values())[-1]  # this unit's request: the newest
    sent, output = recorder.requests[record.request_id]
    expanded = list(output.prompt_token_ids) if output is not None else []
    accounted = list(record.prompt_token_ids)
    grew = (len(accounted) - before[0], len(expanded) - before[1])
    row.update(
        sent_tokens=len(sent["prompt_token_ids"]),
        accounted_tokens=len(accounted),
        expanded_tokens=len(expanded),
        model_tokens=row["budget"] + grew[1] - grew[0],
        prompts_equal=expanded == accounted,
    )
    row["ok"] = row["model_tokens"] == row["budget"]
    return row


def _report(rows: list[dict[str, Any]], args: argparse.Namespace) -> int:
    width = max(len(row["unit"]) for row in rows)
    print(f"{'unit':<{width}}  budget  model  prompt: accounted  expanded  result")
    for row in rows:
        result = "ok" if row["ok"] else row.get("error", "model's count differs from the budget")
        print(
            f"{row['unit']:<{width}}  {row['budget']:>6}  {row.get('model_tokens', '-'):>5}"
            f"  {row.get('accounted_tokens', '-'):>17}  {row.get('expanded_tokens', '-'):>8}"
            f"  {result}"
        )
    passed = all(row["ok"] for row in rows)
    RESULTS.write_text(json.dumps({"model": args.model, "passed": passed, "units": rows}, indent=2))
    print(f"{'all units expand to their budgets' if passed else 'MISMATCH'}; wrote {RESULTS}")
    return 0 if passed else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="openbmb/MiniCPM-o-4_5")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context-reserve", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--audio-marker", default=None, help="default: MiniCPM-o's")
    parser.add_argument("--audio-only", action="store_true")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    sys.exit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
