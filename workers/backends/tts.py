"""Speech for the client (espeak-ng on CPU), cancellable mid-utterance.

The ``tts`` stage reads the thinker. Text deltas are gathered until a
sentence or clause is complete (``split_ready``, pure); each one is spoken by
an ``espeak-ng --stdout`` subprocess whose WAV output is read as it comes,
resampled from espeak's 22.05 kHz to ``sample_rate`` and sent as
``pcm_s16le`` ``audio_delta`` outputs of ``chunk_ms`` each (flush: the
client hears the first words while the rest is being synthesized). Before
its audio each sentence goes out as a ``transcript`` (with ``transcript``),
what OpenAI Realtime calls the audio transcript. A ``done`` speaks the tail
that is left and answers ``done``.

Cancelling is the path a barge-in takes: the runtime cancels the task
running ``handle``, and the subprocess is killed in the ``finally`` that the
cancel runs through, before anything more is yielded; ``release`` kills any
synthesis still running for the released fence and forgets the text not yet
spoken, since it belongs to the cancelled response.

With ``pace`` > 0 the audio is held to that multiple of real time, at most
``lead_ms`` ahead of the listener (``Pacer``, pure). Sent faster, a whole
answer would sit in the client's buffer and a barge-in could no longer stop
it on the server; paced, what was sent is close to what was heard.

The session's settings (``ctx.session``, from ``session.update``) choose the
voice (the reference API's names map to espeak-ng voices, ``VOICES``; other
names are espeak-ng's own), the speed (``audio.output.speed`` times the stage's
``words_per_minute``, ``words_per_minute``) and, with text-only output, silence:
the text is not spoken and the response ends with its ``done`` as usual.

Text goes to espeak-ng on its stdin, never as an argument, so no text can be
read as an option. ``continuous_input`` is false: text of a cancelled
response is not spoken.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.events import CommitPayload, InputEvent, OutputEvent, OutputKind, TextPayload
from schemas.fence import Fence
from workers.backends.audio import Samples, StreamResampler, WavStream, encode_pcm
from workers.backends.base import NO_HISTORY, BackendError, OutputDraft, StageContext, StageEvent

_STATE_KEY = "tts"
_READ_BYTES = 8192
_BOUNDARY = re.compile(r"[.!?;:]+[\"')\]]*\s+|\n+")
_CLAUSE = re.compile(r"[,\u2014-]\s+|\s+")
_SPOKEN = re.compile(r"\w")


class TtsOptions(BaseModel):
    """Options of a ``tts`` stage (``StageConfig.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    voice: str = Field("en", pattern=r"^[A-Za-z0-9][A-Za-z0-9_+-]{0,39}$")
    """espeak-ng voice (``en``, ``en-us``, ``en+f3``, ...)."""
    words_per_minute: int = Field(175, ge=80, le=450)
    pitch: int = Field(50, ge=0, le=99)
    sample_rate: Literal[16_000, 22_050, 24_000, 48_000] = 24_000
    """Rate of the audio sent to the client."""
    chunk_ms: int = Field(160, ge=20, le=2000)
    """Audio per output delta."""
    pace: float = Field(0.0, ge=0.0, le=16.0)
    """Send audio at most this many times faster than real time (0: as synthesized)."""
    lead_ms: int = Field(500, ge=0, le=60_000)
    """How far paced audio may run ahead of the listener."""
    max_clause_chars: int = Field(240, ge=20, le=4000)
    """Text without a sentence end is spoken in clauses of at most this length."""
    speak: tuple[Literal["text_delta", "transcript"], ...] = ("text_delta",)
    """Output kinds of the upstream stage that are spoken."""
    transcript: bool = True
    """Send each sentence as a ``transcript`` before its audio."""
    espeak: str = "espeak-ng"
    """The espeak-ng executable (a name on PATH or a path)."""


VOICES = {
    "alloy": "en-us", "ash": "en-us+m3", "ballad": "en-gb-x-rp+m2", "coral": "en-us+f3",
    "echo": "en-us+m1", "sage": "en-gb+f2", "shimmer": "en-us+f4", "verse": "en-us+m4",
    "marin": "en-us+f1", "cedar": "en-gb+m1",
}  # fmt: skip
"""The reference API's voice names and the espeak-ng voice each speaks with; any
other name a session asks for is taken as an espeak-ng voice."""


def espeak_voice(session_voice: str, default: str) -> str:
    """The espeak-ng voice for a session's chosen voice (its stage's when none)."""
    if not session_voice:
        return default
    return VOICES.get(session_voice.lower(), session_voice)


ESPEAK_WPM = (80, 450)
"""The speeds espeak-ng speaks at (words per minute)."""


def words_per_minute(stage_wpm: int, speed: float) -> int:
    """The session's ``speed`` (0.25 to 1.5) as espeak-ng's words per minute: the stage's
    own times ``speed``, within what espeak-ng does (80 to 450)."""
    low, high = ESPEAK_WPM
    return max(low, min(high, round(stage_wpm * speed)))


def split_ready(text: str, *, final: bool, max_chars: int) -> tuple[list[str], str]:
    """Cut ``text`` into what can be spoken now and what waits for more text.

    Whole sentences (and lines) are ready; a run longer than ``max_chars``
    without one is cut at its last comma or space that fits; with ``final``
    the rest is ready too. Pieces without a letter or digit are dropped.
    """
    ready: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        ready.append(text[start : match.end()])
        start = match.end()
    rest = text[start:]
    while len(rest) > max_chars:
        cuts = [m.end() for m in _CLAUSE.finditer(rest, 0, max_chars) if m.end() <= max_chars]
        cut = cuts[-1] if cuts else max_chars
        ready.append(rest[:cut])
        rest = rest[cut:]
    if final:
        ready.append(rest)
        rest = ""
    return [piece.strip() for piece in ready if _SPOKEN.search(piece)], rest


class Pacer:
    """Holds audio to ``pace`` times real time, at most ``lead_s`` ahead (pure)."""

    def __init__(self, pace: float, lead_s: float) -> None:
        self.pace = pace
        self.lead_s = lead_s
        self._heard_at = 0.0
        """Clock time at which the listener will have heard everything sent."""

    def delay(self, duration_s: float, now: float) -> float:
        """Seconds to wait before sending ``duration_s`` of audio at clock ``now``;
        the audio counts as sent once that wait is over."""
        if self.pace <= 0:
            return 0.0
        start = max(self._heard_at, now)
        wait = max(0.0, start - now - self.lead_s)
        self._heard_at = start + duration_s / self.pace
        return wait


@dataclass
class TtsSession:
    pacer: Pacer
    text: str = ""
    """Text received but not yet spoken."""
    epoch: int = 0
    """The epoch the text was received in."""
    running: dict[asyncio.subprocess.Process, int] = field(default_factory=dict)
    """Synthesis processes running, with the epoch they speak for."""
    sentences: int = 0


class TtsBackend:
    """espeak-ng speech, sentence by sentence, killed on barge-in."""

    name = "tts"
    continuous_input = False
    follows_responses = True
    """The speech belongs to the response being spoken; a newer one supersedes it."""
    edits_conversation = False
    rebuild = NO_HISTORY
    """Nothing to rebuild: every event is answered on its own."""

    def __init__(
        self,
        options: Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            self.options = TtsOptions.model_validate(dict(options or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid tts stage options: {exc}") from exc
        executable = shutil.which(self.options.espeak)
        if executable is None:
            raise ValueError(
                f"tts stage: {self.options.espeak!r} not found (apt install espeak-ng)"
            )
        self._executable = executable
        self._clock = clock
        self._sessions: dict[str, TtsSession] = {}
        self.killed = 0
        """Synthesis processes killed before they finished (barge-in, close)."""

    # -- contract ----------------------------------------------------------------

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        """Fresh state: after a failover, speech of a response in progress is not resumed
        mid-sentence; the text of its remaining events is spoken as they arrive."""
        self._session(ctx)

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        session = self._session(ctx)
        if ctx.fence.epoch > session.epoch:
            session.text, session.sentences, session.epoch = "", 0, ctx.fence.epoch
        text, done = self._read(event)
        if not ctx.session.audio_output:
            text = ""  # text-only output: the response ends here, nothing is spoken
        ready, session.text = split_ready(
            session.text + text, final=done, max_chars=self.options.max_clause_chars
        )
        for sentence in ready:
            async with contextlib.aclosing(self._speak(ctx, session, sentence)) as drafts:
                async for draft in drafts:
                    yield draft
        if done:
            yield OutputDraft(OutputKind.DONE, meta={"sentences": session.sentences})
            session.sentences = 0

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        """Text of an interrupted response is not spoken."""

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        session = self._session(ctx)
        if session.epoch <= fence.epoch:
            # The held text belongs to the released response (not to a newer one that
            # may already have started) and the listener's buffer is flushed.
            session.text, session.sentences, session.pacer = "", 0, self._pacer()
        for process, epoch in list(session.running.items()):
            if epoch <= fence.epoch:
                self._kill(session, process)

    async def stop(self, ctx: StageContext) -> None:
        session = self._sessions.pop(ctx.session_id, None)
        ctx.state.pop(_STATE_KEY, None)
        if session is not None:
            for process in list(session.running):
                self._kill(session, process)

    async def aclose(self) -> None:
        for session in list(self._sessions.values()):
            for process in list(session.running):
                self._kill(session, process)
        self._sessions.clear()

    # -- core --------------------------------------------------------------------

    def _pacer(self) -> Pacer:
        return Pacer(self.options.pace, self.options.lead_ms / 1000)

    def _session(self, ctx: StageContext) -> TtsSession:
        session = ctx.state.get(_STATE_KEY)
        if not isinstance(session, TtsSession):
            session = ctx.state[_STATE_KEY] = TtsSession(self._pacer())
            self._sessions[ctx.session_id] = session
        return session

    def _read(self, event: StageEvent) -> tuple[str, bool]:
        """(text to speak, whether the response ends) of one event."""
        if isinstance(event, InputEvent):
            payload = event.payload
            if isinstance(payload, TextPayload):
                return payload.text, False
            return "", isinstance(payload, CommitPayload)
        if event.kind is OutputKind.DONE:
            return "", True
        if event.kind.value in self.options.speak:
            return event.text, False
        return "", False

    async def _speak(
        self, ctx: StageContext, session: TtsSession, sentence: str
    ) -> AsyncGenerator[OutputDraft, None]:
        """One sentence: its transcript, then its audio as it is synthesized."""
        session.sentences += 1
        index = session.sentences
        if self.options.transcript:
            # The transcript deltas of a response concatenate to what it said.
            yield OutputDraft(
                OutputKind.TRANSCRIPT,
                text=sentence if index == 1 else f" {sentence}",
                meta={"sentence": index, "role": "assistant"},
                flush=True,
            )
        opts = self.options
        voice = espeak_voice(ctx.session.voice, opts.voice)
        wpm = words_per_minute(opts.words_per_minute, ctx.session.speed)
        process = await asyncio.create_subprocess_exec(
            self._executable, "--stdout", "--stdin", "-v", voice,
            "-s", str(wpm), "-p", str(opts.pitch),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        session.running[process] = ctx.fence.epoch
        try:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(sentence.encode())
            process.stdin.close()
            chunker = _Chunker(opts.sample_rate, opts.sample_rate * opts.chunk_ms // 1000)
            while data := await process.stdout.read(_READ_BYTES):
                for piece in chunker.feed(data):
                    yield await self._paced(session, piece, index)
            for piece in chunker.finish():
                yield await self._paced(session, piece, index, last=True)
            if await process.wait() != 0:
                if voice != opts.voice:
                    raise BackendError(f"voice {ctx.session.voice!r} is not available")
                raise BackendError(f"espeak-ng failed ({process.returncode}) on {sentence!r}")
        finally:
            # A cancel (barge-in) comes through here: the process dies before anything
            # more is yielded; draining its pipe reaps it and closes the pipe.
            self._kill(session, process)
            await process.communicate()

    async def _paced(
        self, session: TtsSession, piece: Samples, sentence: int, *, last: bool = False
    ) -> OutputDraft:
        rate = self.options.sample_rate
        wait = session.pacer.delay(len(piece) / rate, self._clock())
        if wait > 0:
            await asyncio.sleep(wait)
        return OutputDraft(
            OutputKind.AUDIO_DELTA,
            data=encode_pcm(piece, "pcm_s16le"),
            meta={"format": "pcm_s16le", "sample_rate": rate, "sentence": sentence, "last": last},
            flush=True,
        )

    def _kill(self, session: TtsSession, process: asyncio.subprocess.Process) -> None:
        """Kill a synthesis that is still running (once). Only the task speaking through
        the process reaps it (``_speak``), since only it may read its pipe."""
        if session.running.pop(process, None) is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
                self.killed += 1


class _Chunker:
    """espeak-ng WAV bytes in, fixed-size chunks of resampled audio out."""

    def __init__(self, rate: int, chunk: int) -> None:
        self._wav = WavStream()
        self._rate = rate
        self._chunk = chunk
        self._resampler: StreamResampler | None = None
        self._held: Samples = np.zeros(0, dtype=np.float32)

    def feed(self, data: bytes) -> list[Samples]:
        samples = self._wav.feed(data)
        if self._wav.sample_rate is None:
            return []
        if self._resampler is None:
            self._resampler = StreamResampler(self._wav.sample_rate, self._rate)
        return self._take(self._resampler.process(samples), final=False)

    def finish(self) -> list[Samples]:
        if self._resampler is None:
            return []
        return self._take(self._resampler.flush(), final=True)

    def _take(self, samples: Samples, *, final: bool) -> list[Samples]:
        held = np.concatenate([self._held, samples])
        whole = len(held) - len(held) % self._chunk
        pieces = [held[i : i + self._chunk] for i in range(0, whole, self._chunk)]
        self._held = held[whole:]
        if final and len(self._held):
            pieces.append(self._held)
            self._held = np.zeros(0, dtype=np.float32)
        return pieces
