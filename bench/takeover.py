"""Takeover of a long voice session: what a stage's new owner reads, and how long it takes.

``python -m bench.takeover [--minutes 30]`` writes the streams of one voice
session of the default pipeline (vad -> asr -> thinker -> tts) as they stand
after ``--minutes`` of conversation: 40 ms audio chunks from the client, an
utterance of 5 s every 10 s cut into VAD segments, a transcript per utterance,
a 40-token answer per turn and 3 s of spoken answer per turn. Then, for each
stage, it times what a new owner reads before it can serve the session
(``workers.rebuild.load_takeover``) with the window the stage's backend
declares, and, side by side in the same run, reading the whole history (the
takeover before the windows); then how long the backend takes to rebuild its
state from what it read. The lease TTL (3 s by default) is the bound a
takeover must stay well within; the lease is also renewed while it runs.
Results go to ``bench/takeover.json``; docs/data-plane.md quotes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, private_redis
from dataplane.bus import RedisBus
from schemas.events import (
    AudioPayload,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    encode_event,
)
from schemas.fence import Fence
from schemas.keys import Keys
from workers.backends.asr import AsrBackend
from workers.backends.base import ALL_HISTORY, NO_HISTORY, RebuildWindow, StageContext
from workers.backends.vad import VadBackend
from workers.backends.vllm_history import ChatHistory, rebuild
from workers.rebuild import Takeover, load_takeover

SID = "voice"
CHUNK_S = 0.04
TURN_S = 10.0
SPEECH_S = 5.0
ANSWER_TOKENS = 40
ANSWER_AUDIO_S = 3.0
VAD_SEGMENT_S = 0.1
WINDOWS: dict[str, RebuildWindow] = {
    "vad": VadBackend().rebuild,
    "asr": AsrBackend.rebuild,
    "thinker": RebuildWindow(resumes_answers=True),  # the vLLM backend: all of it
    "tts": NO_HISTORY,
}
INPUTS = {"vad": "in", "asr": "vad", "thinker": "asr", "tts": "thinker"}
TO_CLIENT = ("asr", "thinker", "tts")
"""The default pipeline's client-facing stages: their outputs go to the client journal too;
those of tts, which no stage reads, only there (``PipelineConfig.outputs_in_journal``)."""
JOURNAL_ONLY = ("tts",)
REPEATS = 3


def _out(stage: str, kind: OutputKind, seq: int, source: int, **fields: Any) -> bytes:
    fence = Fence(SID, 0, 0, fields.pop("turn", 0), fields.pop("turn", 0))
    return encode_event(OutputEvent(fence, stage, kind, seq, source, **fields))


def session_streams(minutes: float) -> dict[str, list[bytes]]:
    """Every stream of the session, as encoded events, oldest first."""
    pcm24 = bytes(int(CHUNK_S * 24_000) * 2)
    streams: dict[str, list[bytes]] = {name: [] for name in ("in", *INPUTS, "journal")}
    chunks = int(minutes * 60 / CHUNK_S)
    for seq in range(1, chunks + 1):
        payload = AudioPayload(pcm24, "pcm_s16le", 24_000)
        event = InputEvent(Fence(SID), seq, seq, InputMode.APPEND_AUDIO_CHUNK, payload)
        streams["in"].append(encode_event(event))
    seqs = dict.fromkeys(INPUTS, 0)

    def out(stage: str, kind: OutputKind, source: int, **fields: Any) -> None:
        seqs[stage] += 1
        raw = _out(stage, kind, seqs[stage], source, **fields)
        if stage not in JOURNAL_ONLY:
            streams[stage].append(raw)
        if stage in TO_CLIENT:
            streams["journal"].append(raw)

    segment = bytes(int(VAD_SEGMENT_S * 16_000) * 2)
    answer = bytes(int(CHUNK_S * 24_000) * 2)
    for turn in range(int(minutes * 60 / TURN_S)):
        end = int((turn * TURN_S + SPEECH_S) / CHUNK_S)
        out("vad", OutputKind.SPEECH_STARTED, end - 1)
        out("vad", OutputKind.SPEECH_STOPPED, end)
        for _ in range(int(SPEECH_S / VAD_SEGMENT_S)):
            out("vad", OutputKind.AUDIO_DELTA, end, data=segment)
        out("vad", OutputKind.DONE, end, meta={"turn_end": True})
        for kind in (OutputKind.SPEECH_STARTED, OutputKind.SPEECH_STOPPED, OutputKind.TRANSCRIPT):
            out("asr", kind, seqs["vad"], text="what a long day it has been today")
        out("asr", OutputKind.DONE, seqs["vad"], meta={"turn_end": True})
        for _ in range(ANSWER_TOKENS):
            out("thinker", OutputKind.TEXT_DELTA, seqs["asr"], text=" word", token_ids=(1,))
        out("thinker", OutputKind.DONE, seqs["asr"])
        for _ in range(int(ANSWER_AUDIO_S / CHUNK_S)):
            out("tts", OutputKind.AUDIO_DELTA, seqs["thinker"], data=answer)
        out("tts", OutputKind.DONE, seqs["thinker"])
    return streams


async def write(bus: RedisBus, streams: dict[str, list[bytes]]) -> dict[str, str]:
    """XADD every stream; returns each stream's last entry id."""
    sk = bus.keys.session(SID)
    names = {"in": sk.input, "journal": sk.client}
    names.update({stage: sk.stage_out(stage) for stage in INPUTS})
    last: dict[str, str] = {}
    for name, events in streams.items():
        if not events:
            continue
        for start in range(0, len(events), 1000):
            async with bus.client.pipeline(transaction=False) as pipe:
                for raw in events[start : start + 1000]:
                    pipe.xadd(names[name], {"e": raw})
                ids = await pipe.execute()
        last[name] = ids[-1].decode()
    return last


async def rebuild_seconds(stage: str, takeover: Takeover) -> float:
    """How long the stage's backend takes to rebuild the session from what was read
    (the VAD runs its network over the audio since the last turn end; the thinker
    rebuilds its chat history, timed without an engine; TTS rebuilds nothing)."""
    backend: VadBackend | AsrBackend | None = None
    if stage == "vad":
        backend = VadBackend()
        assert backend.model is not None  # loaded once per process, not per takeover
    elif stage == "asr":
        backend = AsrBackend()
    began = time.perf_counter()
    if backend is not None:
        ctx = StageContext(SID, stage, Fence(SID), {})
        await backend.start(ctx, takeover.inputs, takeover.outputs)
    elif stage == "thinker":
        own = [o for o in takeover.outputs if o.stage == stage]
        rebuild(ChatHistory(32), takeover.inputs, own)
    return time.perf_counter() - began


async def measure(minutes: float) -> dict[str, Any]:
    streams = session_streams(minutes)
    with private_redis("takeover") as server:
        bus = RedisBus(server.url, Keys("bench"))
        try:
            last = await write(bus, streams)
            memory = await bus.client.info("memory")
            sk = bus.keys.session(SID)
            stages: dict[str, Any] = {}
            for stage, source in INPUTS.items():
                input_stream = sk.input if source == "in" else sk.stage_out(source)
                journal = stage in JOURNAL_ONLY  # its outputs are read from the journal
                output_stream = sk.client if journal else sk.stage_out(stage)
                only = stage if journal else None
                applied = len(streams[source])
                row: dict[str, Any] = {}
                for label, window in (("declared", WINDOWS[stage]), ("whole", ALL_HISTORY)):
                    times = []
                    for _ in range(REPEATS):  # the best of a few: the machine is noisy
                        began = time.perf_counter()
                        takeover = await load_takeover(
                            bus, input_stream, output_stream, read_id=last[source],
                            applied_seq=applied, window=window, stage=only,
                        )  # fmt: skip
                        times.append(time.perf_counter() - began)
                    row[label] = {
                        "seconds": round(min(times), 4),
                        "inputs": len(takeover.inputs),
                        "outputs": len(takeover.outputs),
                    }
                row["ratio"] = round(
                    row["whole"]["seconds"] / max(row["declared"]["seconds"], 1e-6), 1
                )
                declared = await load_takeover(
                    bus, input_stream, output_stream, read_id=last[source],
                    applied_seq=applied, window=WINDOWS[stage], stage=only,
                )  # fmt: skip
                row["rebuild_seconds"] = round(await rebuild_seconds(stage, declared), 4)
                stages[stage] = row
        finally:
            await bus.aclose()
    return {
        "minutes": minutes,
        "entries": {name: len(events) for name, events in streams.items()},
        "redis_memory_mb": round(int(memory["used_memory"]) / 2**20, 1),
        "stages": stages,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.takeover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "takeover.json")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.minutes))
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
