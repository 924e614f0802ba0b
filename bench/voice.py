"""13. Voice to voice: from the end of the user's speech to the answer's first audio.

``python -m bench --only voice`` starts the default pipeline as ``duplexq up
--workers 1`` ships it (server VAD -> ASR -> thinker on vLLM -> TTS; the model
``scripts/setup`` prepared) with tracing on (``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing
at an OTLP/HTTP receiver this benchmark runs), and one Realtime WebSocket client.
The client streams each question, spoken by espeak-ng, in real time (40 ms of 24 kHz
PCM16 per append, as the demo page sends), then silence, and lets the server VAD end
the turn. Voice to voice is from the moment the last chunk holding speech was sent to
the answer's first ``response.output_audio.delta``.

The breakdown is the turn's trace as the product emits it: the waterfall event
(``duplexq.turn.trace``) gives each stage's work and the time that is duplexq's own
(between one stage making an output and the next taking it, and from the last stage
to the client: queues, Redis, fencing, coalescing). What is left of voice to voice
before the trace begins is the VAD's wait for silence (its ``silence_ms``) plus the
last chunk's trip to the coordinator. The receiver counts each turn's spans.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import PrivateRedis
from bench.mdformat import f, failed, table

QUESTIONS = (
    "What is the capital of France?",
    "How many days are in a week?",
    "What color is the sky?",
    "What is two plus two?",
    "Name a fruit that is yellow.",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Which planet do we live on?",
    "What animal says moo?",
)
RATE = 24_000
CHUNK_MS = 40
TURN_S = 90.0
"""Longest one turn may take (answer played in real time included)."""


def _pcm16_chunks(samples: np.ndarray) -> tuple[list[str], int]:
    """Base64 PCM16 chunks of ``samples`` and the index of the last one holding speech."""
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    step = RATE * CHUNK_MS // 1000
    pieces = [pcm[i : i + step] for i in range(0, len(pcm), step)]
    loud = [i for i, p in enumerate(pieces) if np.abs(p).max(initial=0) > 300]
    return [base64.b64encode(p.tobytes()).decode() for p in pieces], loud[-1]


class _Turn:
    """One spoken turn's measurements, from the client's side."""

    def __init__(self) -> None:
        self.speech_end = 0.0
        self.first_audio: float | None = None
        self.waterfall: dict[str, Any] | None = None
        self.done = False


async def _listen(ws: Any, turn: _Turn) -> None:
    while not (turn.done and turn.waterfall is not None):
        event = json.loads(await ws.recv())
        kind = event["type"]
        # Only the answer to this turn's question counts: audio once the speech was
        # sent, and the waterfall that follows that audio (not a late one of before).
        if kind == "response.output_audio.delta" and turn.first_audio is None:
            if turn.speech_end:
                turn.first_audio = time.monotonic()
        elif kind == "duplexq.turn.trace" and turn.first_audio is not None:
            turn.waterfall = turn.waterfall or event
        elif kind == "response.done" and turn.first_audio is not None:
            turn.done = True
        elif kind == "error":
            raise RuntimeError(f"server error: {event}")


async def _speak_turn(ws: Any, text: str) -> _Turn:
    from tests.speech import silence, speak

    chunks, last_loud = _pcm16_chunks(np.concatenate([speak(text, RATE), silence(0.2, RATE)]))
    quiet = base64.b64encode(bytes(2 * RATE * CHUNK_MS // 1000)).decode()
    turn = _Turn()
    listener = asyncio.create_task(_listen(ws, turn))
    started = time.monotonic()
    sent = 0
    try:
        async with asyncio.timeout(TURN_S):
            while not listener.done():
                chunk = chunks[sent] if sent < len(chunks) else quiet
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                if sent == last_loud:
                    turn.speech_end = time.monotonic()
                sent += 1
                # Real time: chunk n is sent at n * 40 ms.
                await asyncio.sleep(max(0.0, started + sent * CHUNK_MS / 1000 - time.monotonic()))
            listener.result()
    finally:
        listener.cancel()
    return turn


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 1)


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": _pct(values, 0.5), "p95_ms": _pct(values, 0.95),
            "mean_ms": round(statistics.fmean(values), 1)}  # fmt: skip


def summarize(turns: list[_Turn], spans: dict[str, int]) -> dict[str, Any]:
    """The section's figures from the turns that were answered with audio."""
    measured = [t for t in turns if t.first_audio is not None and t.waterfall is not None]
    v2v = [(t.first_audio - t.speech_end) * 1000 for t in measured]  # type: ignore[operator]
    shown = [t.waterfall for t in measured]
    own = [w["own_ms"] for w in shown]  # type: ignore[index]
    stages: dict[str, dict[str, list[float]]] = {}
    for w in shown:
        for s in w["stages"]:  # type: ignore[index]
            entry = stages.setdefault(s["stage"], {"work": [], "queued": [], "busy": []})
            entry["work"].append(s["work_ms"])
            entry["queued"].append(s["queued_ms"])
            entry["busy"].append(s["busy_ms"])
    detect = [v - w["total_ms"] for v, w in zip(v2v, shown, strict=True)]  # type: ignore[index]
    v2v_s, own_s = _summary(v2v), _summary(own)
    return {
        "turns": len(turns),
        "measured": len(measured),
        "voice_to_voice": v2v_s,
        "own": own_s,
        "delivery": _summary([w["delivery_ms"] for w in shown]),  # type: ignore[index]
        "turn_detection": _summary(detect),
        "stages": {
            name: {key: _summary(values) for key, values in v.items()} for name, v in stages.items()
        },
        "own_share_p95": round(own_s["p95_ms"] / v2v_s["p95_ms"], 4),
        "per_turn": [
            {"voice_to_voice_ms": round(v, 1), "own_ms": o} for v, o in zip(v2v, own, strict=True)
        ],
        "spans_per_trace": spans,
    }


async def _drive(url: str, key: str, count: int) -> list[_Turn]:
    import websockets

    headers = {"Authorization": f"Bearer {key}"}
    turns = []
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        while json.loads(await ws.recv())["type"] != "session.created":
            pass
        for index in range(count):
            turn = await _speak_turn(ws, QUESTIONS[index % len(QUESTIONS)])
            turns.append(turn)
            got = turn.waterfall or {}
            print(f"  turn {index + 1}: v2v "
                  f"{(turn.first_audio or 0) * 1000 - turn.speech_end * 1000:.0f} ms, "
                  f"own {got.get('own_ms')} ms", flush=True)  # fmt: skip
            await asyncio.sleep(0.5)
    return turns


async def run(
    _server: PrivateRedis, plan: Any, _raw: dict[str, Any], _logs: Path
) -> dict[str, Any]:
    # The default stack runs its own Redis, as `duplexq up` does: the private one the
    # harness started is not used.
    from tests.otlp_receiver import otlp_receiver
    from tests.shipped_stack import serve_shipped_stack

    count = plan.voice_turns
    load_before = os.getloadavg()[0]
    saved = dict(os.environ)
    with otlp_receiver() as receiver, tempfile.TemporaryDirectory(prefix="bench-voice-") as tmp:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        try:
            with serve_shipped_stack(Path(tmp)) as stack:
                turns = await _drive(stack.realtime_url, stack.api_key, count)
                await asyncio.sleep(6)  # the exporters' batch delay (5 s by default)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        per_trace: dict[str, int] = {}
        for span in receiver.spans:
            per_trace[span.trace_id] = per_trace.get(span.trace_id, 0) + 1
    traced = [t.waterfall["trace_id"] for t in turns if t.waterfall]
    counts = [per_trace.get(trace, 0) for trace in traced]
    spans = {"traces": len(traced), "min": min(counts, default=0), "max": max(counts, default=0)}
    # The machine's load (1-minute average) as the run began and ended: every figure here
    # is of processes sharing the machine's cores with whatever else runs.
    load = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2),
            "cores": os.cpu_count()}  # fmt: skip
    return {**summarize(turns, spans), "load": load}


def summary_rows(s: dict[str, Any] | None) -> list[list[Any]]:
    if not s or "error" in s:
        return []
    v, o = s["voice_to_voice"], s["own"]
    return [
        ["13", "voice to voice, default pipeline: p50 / p95",
         f"{f(v['p50_ms'], 0)} / {f(v['p95_ms'], 0)} ms", "-", "-"],
        ["13", "of which duplexq's own (queues, Redis, fencing): p50 / p95",
         f"{f(o['p50_ms'], 0)} / {f(o['p95_ms'], 0)} ms", "goal <= 5 % at p95",
         f"{s['own_share_p95'] * 100:.1f} %"],
    ]  # fmt: skip


def section(s: dict[str, Any] | None) -> str:
    out = ["## 13. Voice to voice on the default pipeline", ""]
    if (msg := failed("voice", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    out.append(
        "The default pipeline as `duplexq up --workers 1` ships it (server VAD, ASR, the\n"
        "thinker on vLLM, TTS), with tracing on, and one Realtime client that speaks\n"
        f"{s['turns']} questions (espeak-ng, streamed in real time, 40 ms of 24 kHz PCM16\n"
        "per append) and lets the server VAD end each turn (`bench/voice.py`). Voice to\n"
        "voice runs from the last chunk holding speech being sent to the answer's first\n"
        "audio delta. The breakdown is the turn's trace as the product emits it\n"
        "(`docs/tracing.md`): each stage's work on the path to the first audio (with the\n"
        "time its input waited while the stage was still busy with earlier input, such\n"
        "as the utterance's end waiting for the ASR to transcribe it), and duplexq's own\n"
        "time between the stages and to the client. Turn detection is what\n"
        "comes before the trace begins: the VAD waiting for its silence, plus the last\n"
        f"chunk's trip to the coordinator. {s['measured']} of {s['turns']} turns were "
        "answered with audio and measured.\n"
    )
    rows = [["voice to voice", s["voice_to_voice"]], ["turn detection", s["turn_detection"]]]
    for name, stage in s["stages"].items():
        rows.append([f"{name}: work", stage["work"]])
        rows.append([f"{name}: of which busy with earlier input", stage["busy"]])
        rows.append([f"{name}: wait before it (duplexq)", stage["queued"]])
    rows.append(["last stage to the client (duplexq)", s["delivery"]])
    rows.append(["**duplexq's own, in all**", s["own"]])
    out.append(table(["part", "p50 ms", "p95 ms", "mean ms"],
                     [[n, f(v["p50_ms"], 1), f(v["p95_ms"], 1), f(v["mean_ms"], 1)]
                      for n, v in rows]))  # fmt: skip
    spans = s["spans_per_trace"]
    out.append(
        f"\nduplexq's own share at p95: **{s['own_share_p95'] * 100:.1f} %** of voice to voice"
        " (p95 of own over p95 of voice to voice). Goal: at most 5 %. Each of the "
        f"{spans['traces']} traces reached the OTLP receiver with {spans['min']} to "
        f"{spans['max']} spans (a root and one per stage)."
    )
    if load := s.get("load"):
        out.append(
            f"\nThe machine's load average was {load['before']:g} as the run began and "
            f"{load['after']:g} as it ended, on {load['cores']} cores: the stages, Redis and\n"
            "the client share those cores with whatever else runs, and a starved process\n"
            "makes every wait longer, duplexq's own included. With the load above the core\n"
            "count the models' times, and so voice to voice, grow far more than duplexq's\n"
            "own, which makes its share look smaller: judge the goal on a run whose load\n"
            "stays below the core count."
        )
    return "\n".join(out)
