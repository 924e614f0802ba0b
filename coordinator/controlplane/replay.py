"""Replay: run a recorded session's input log again, into a new session, and compare.

``replay_session`` reads the source's input log (``dq:{p}:{src}:in``) in order,
opens the target session (with the source's input capabilities) and appends
each input's mode and payload; the authority stamps fresh fences, seqs and
timestamps. Each input first waits until the target has ended the answers the
source had ended before it was recorded (``replay_wait``: a turn's answer depends
on the answers before it, and speech over an answer is a barge-in); then it goes
at once or at the recorded pace (the gaps between their ``ts_ms``, divided by a
speed factor). Progress is reported
through an injectable callback. It then waits until the target's client
journal holds as many outputs as the source's (or stays quiet for a while
after its last output, or a timeout passes), compares the two, and closes
the target so its keys expire like any closed session's.

Only inputs are replayed: a cancel or barge-in the source received is not in
its input log, so a source that was interrupted may legitimately differ.

Greedy replays. A model stage that samples (temperature above 0, no seed) answers
differently each run, so its replay differs from the recording although nothing
is wrong. ``greedy=True`` makes the target's model stages decode greedily: the
target's settings say ``greedy`` from its first event on (a settings event goes
first and every replayed one carries the flag; the stored configuration has it
too, so a stage's new owner keeps it). A greedy replay of a sampled recording
still differs from the recording, so ``replay_greedily`` judges determinism by
replaying twice and comparing the two targets; the comparison with the recording
is reported beside it. (The first of the two waits until its target has ended as
many answers as the recording and then stays quiet for ``quiet_s``: the
recording's count of outputs says nothing of its own; the second waits for as
many outputs as the first got.) A recording that was itself
greedy (a greedy replay's target) is compared directly, once.

Outputs are compared as a client would have received them: a journal is
judged like the output reader does (fence barriers, stale fences and
duplicates dropped; the coordinator's own notices left out, as a replay has no
client connection), then compared stage by stage as ``replay_verdict`` says
(settings and conversation records left out, streams joined as read).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import IO, Any, Literal

import msgspec

from coordinator.controlplane.replay_verdict import (
    NOT_COMPARED,
    STREAMED,
    Comparison,
    Mismatch,
    as_read,
    compare_outputs,
    compared,
    joins,
    output_key,
    summarize,
)
from coordinator.controlplane.replay_wait import TurnWaiter, client_records
from coordinator.output_reader import JournalFollower
from dataplane import session_meta
from dataplane.authority import SessionAuthority
from dataplane.bus import Entry, RedisBus
from schemas.config import PipelineConfig
from schemas.errors import (
    SessionExistsError,
    SessionNotFoundError,
    WireDecodeError,
)
from schemas.events import (
    CommitPayload,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    Payload,
    SettingsPayload,
    decode_input,
)
from schemas.fence import Fence
from schemas.realtime import SessionConfig
from schemas.session_shape import settings_from_json

__all__ = [  # the comparison lives in replay_verdict; these are its names users import
    "STREAMED", "Comparison", "Mismatch", "as_read", "compare_outputs", "joins",
    "output_key", "summarize",
]  # fmt: skip

Pace = Literal["fast", "recorded"]
ProgressFn = Callable[[int, int], None]
"""Called with (inputs appended, inputs to append) after each append."""
SleepFn = Callable[[float], Awaitable[None]]

PAGE = 256
POLL_S = 0.05

# -- comparing outputs (pure) ---------------------------------------------------------


async def client_outputs(bus: RedisBus, session_id: str) -> list[OutputEvent]:
    """Everything a client following ``session_id`` from the start would have received,
    judged by the output reader's own ``JournalFollower``. Coordinator notices
    (``OutputKind.NOTICE``: server events of a client connection, not outputs of the
    pipeline) are left out: a replay has no client connection."""
    follower = _follower(session_id)
    journal = bus.keys.session(session_id).client
    outputs: list[OutputEvent] = []
    start = "-"
    while page := await bus.xrange(journal, start, "+", count=PAGE):
        outputs += pipeline_outputs(follower, page)
        start = "(" + page[-1].id
    return outputs


def _follower(session_id: str) -> JournalFollower:
    return JournalFollower(session_id, Fence(session_id), metrics=False)


def pipeline_outputs(follower: JournalFollower, page: Sequence[Entry]) -> list[OutputEvent]:
    """The outputs of ``page`` a client would receive, without coordinator notices."""
    outputs: list[OutputEvent] = []
    for entry in page:
        delivery = follower.judge(entry)
        if delivery is None or not isinstance(delivery.event, OutputEvent):
            continue
        if delivery.event.kind is not OutputKind.NOTICE:
            outputs.append(delivery.event)
    return outputs


async def compare_sessions(bus: RedisBus, a: str, b: str) -> Comparison:
    """Compare the client outputs of sessions ``a`` and ``b``."""
    return compare_outputs(await client_outputs(bus, a), await client_outputs(bus, b))


# -- pacing and progress (pure but for the printer's writes) ------------------------------


def pace_delay(previous_ts: int | None, ts: int, speed: float) -> float:
    """Seconds to wait before an input recorded at ``ts`` (ms) when the previous
    one was at ``previous_ts``; unknown or backwards clocks wait nothing."""
    if previous_ts is None or previous_ts <= 0 or ts <= previous_ts:
        return 0.0
    return (ts - previous_ts) / 1000 / speed


def progress_bar(done: int, total: int, width: int = 30) -> str:
    """``[#######.......]  45/100  45%``."""
    fraction = done / total if total else 1.0
    filled = round(width * fraction)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {fraction:4.0%}"


class ProgressPrinter:
    """Progress on a stream: a redrawn bar on a TTY, else a line per ``step`` percent."""

    def __init__(self, stream: IO[str] | None = None, *, step: int = 10, label: str = "replay"):
        self.stream = stream or sys.stderr
        self.step = step
        self.label = label
        self._tty = self.stream.isatty()
        self._reported = -1
        self._done = 0

    def __call__(self, done: int, total: int) -> None:
        if done < self._done:  # the next replay (a greedy replay runs two)
            self._reported = -1
        self._done = done
        if self._tty:
            end = "\n" if done >= total else ""
            self.stream.write(f"\r{self.label} {progress_bar(done, total)}{end}")
            self.stream.flush()
            return
        bucket = (100 * done // total if total else 100) // self.step
        if bucket > self._reported:
            self._reported = bucket
            self.stream.write(f"{self.label}: {min(bucket * self.step, 100)}% ({done}/{total})\n")
            self.stream.flush()


class LogProgress:
    """Progress as log lines, one per ``step`` percent (for the control plane)."""

    def __init__(self, label: str, logger: logging.Logger, *, step: int = 10) -> None:
        self.label = label
        self.logger = logger
        self.step = step
        self._reported = -1
        self._done = 0

    def __call__(self, done: int, total: int) -> None:
        if done < self._done:  # the next replay (a greedy replay runs two)
            self._reported = -1
        self._done = done
        bucket = (100 * done // total if total else 100) // self.step
        if bucket > self._reported:
            self._reported = bucket
            self.logger.info("%s: %d/%d inputs", self.label, done, total)


# -- the replay ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a replay did and how the target's outputs compare with the source's."""

    source: str
    target: str
    pipeline: str
    pace: str
    speed: float
    inputs: int
    """Inputs appended to the target."""
    skipped: int
    """Log entries that did not decode (not replayed)."""
    first_seq: int
    """Seq of the first replayed input; above 1 when the source log was trimmed."""
    complete: bool
    """Whether the target produced as many outputs as its reference before the wait
    ended (a greedy replay of a sampled source: whether it went quiet, ``quiet_s``,
    before the timeout)."""
    comparison: Comparison
    """The target's outputs against the reference's (the source's, unless ``reference``)."""
    elapsed_s: float
    greedy: bool = False
    """The target's model stages decoded greedily (``SettingsPayload.greedy``)."""
    source_greedy: bool = False
    """The source's settings were greedy: it is itself a greedy replay's target."""
    reference: str = ""
    """The session the target was compared with when not the source (a second greedy
    replay is compared with the first)."""
    again: ReplayReport | None = None
    """A greedy replay of a sampled source: the second greedy replay, compared with this
    one's target. It decides the verdict; ``comparison`` (with the sampled source)
    is shown beside it."""

    @property
    def matches(self) -> bool:
        """The target's outputs equal its reference's, all of them."""
        return self.complete and self.comparison.identical

    @property
    def identical(self) -> bool:
        """The verdict: the target reproduced the source; for a greedy replay of a
        sampled source, the second greedy replay reproduced the first."""
        return self.matches if self.again is None else self.again.matches

    def summary(self) -> str:
        verdict = "identical" if self.identical else "DIFFERENT"
        mode = f"{self.pace}{'' if self.pace == 'fast' else f' x{self.speed:g}'}"
        if self.greedy:
            mode += ", greedy"
        if self.again is not None:
            verdict = f"greedy replays {verdict}"
        lines = [f"replay {self.source} -> {self.target} ({self.pipeline}, {mode}): {verdict}"]
        lines += self._comparison_lines()
        if self.again is not None:
            lines.append(
                f"  the source sampled, so the verdict compares two greedy replays; "
                f"against the source this one is {'identical' if self.matches else 'different'}"
            )
            lines.append(f"  second greedy replay {self.again.target}, against {self.target}:")
            lines += ["  " + line for line in self.again._comparison_lines()]
        return "\n".join(lines)

    def _comparison_lines(self) -> list[str]:
        c = self.comparison
        against = f" (against {self.reference})" if self.reference else ""
        lines = [
            f"  inputs {self.inputs} (skipped {self.skipped}, first seq {self.first_seq}), "
            f"outputs {c.source_outputs} -> {c.target_outputs}{against}, matched {c.matched}, "
            f"{self.elapsed_s:.2f}s{'' if self.complete else ', target incomplete'}",
        ]
        if c.first_mismatch is not None:
            m = c.first_mismatch
            lines += m.describe(self.reference or "source")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for a job result or JSON)."""
        data = asdict(self)
        data["identical"] = self.identical
        return data


async def _input_pages(bus: RedisBus, stream: str, end: str) -> AsyncIterator[list[Entry]]:
    start = "-"
    while page := await bus.xrange(stream, start, end, count=PAGE):
        yield page
        start = "(" + page[-1].id


async def _source_capabilities(bus: RedisBus, source: str) -> list[InputMode] | None:
    return [InputMode(mode) for mode in await session_meta.capabilities(bus, source)] or None


async def recorded_greedily(bus: RedisBus, session_id: str) -> bool:
    """Whether ``session_id``'s stored settings are greedy (a greedy replay's target)."""
    raw = await session_meta.config_json(bus, session_id)
    try:
        return settings_from_json(raw).greedy
    except ValueError:
        return False


def greedy_payload(payload: Payload) -> Payload:
    """A replayed input's payload for a greedy target: settings keep ``greedy``."""
    if isinstance(payload, SettingsPayload) and not payload.greedy:
        return msgspec.structs.replace(payload, greedy=True)
    return payload


def untraced(payload: Payload) -> Payload:
    """A replayed input's payload without the original turn's trace: a replay's turns
    are not the recorded ones (``tests/test_tracing.py``)."""
    if isinstance(payload, CommitPayload) and payload.trace is not None:
        return msgspec.structs.replace(payload, trace=None)
    return payload


async def _open_target(
    authority: SessionAuthority, bus: RedisBus, source: str, target: str, greedy: bool
) -> None:
    """Open the target like the source; a greedy one is greedy from its first event."""
    caps = await _source_capabilities(bus, source)
    if greedy and caps is not None and InputMode.UPDATE_SESSION not in caps:
        caps.append(InputMode.UPDATE_SESSION)
    await authority.open(target, caps)
    # A stage's new owner starts from the session's stored settings and applies the
    # settings events after its position (as on a live session): the target stores the
    # source's, so an owner that takes over mid-replay keeps instructions, voice, ...
    raw = await session_meta.config_json(bus, source)
    if raw or greedy:
        config = SessionConfig.model_validate_json(raw) if raw else SessionConfig()
        if greedy:
            config = config.model_copy(update={"greedy": True})
        await session_meta.store_config(bus, target, config)
    if greedy:
        # Sent in order to the stages that own the session already.
        await authority.append(target, InputMode.UPDATE_SESSION, SettingsPayload(greedy=True))


async def _wait_outputs(
    bus: RedisBus,
    target: str,
    expected: int | None,
    timeout_s: float,
    quiet_s: float,
    *,
    responses: int = 0,
    pieces: int = 0,
) -> tuple[list[OutputEvent], bool]:
    """Follow the target's journal until it holds ``expected`` outputs as read, until it
    stays quiet for ``quiet_s`` or until the timeout; the outputs, and whether it got
    them. ``expected=None``: until quiet or timeout, and whether it got quiet; quiet
    counts only once ``responses`` answers have ended (as many as the recording's: a
    busy engine may pause longer than ``quiet_s`` between two of them). ``pieces``: the
    recording's outputs as they came (deltas not joined); a target that ends on a stream
    is taken as complete once it has as many, instead of after ``quiet_s``."""
    follower = _follower(target)
    journal = bus.keys.session(target).client
    outputs: list[OutputEvent] = []
    read = ended = 0  # outputs as compared (``compared``); answers ended
    start = "-"
    last_growth = time.monotonic()
    deadline = last_growth + timeout_s
    while expected is None or not _got(read, outputs, expected, pieces):
        page = await bus.xrange(journal, start, "+", count=PAGE)
        if page:
            start = "(" + page[-1].id
            events = [e for e in pipeline_outputs(follower, page) if e.kind not in NOT_COMPARED]
            outputs += events
            ended += sum(event.kind is OutputKind.DONE for event in events)
            if events:
                read = len(compared(outputs))
                last_growth = time.monotonic()
            continue
        now = time.monotonic()
        if now >= deadline:
            return outputs, False
        if read and ended >= responses and now - last_growth >= quiet_s:
            return outputs, expected is None or read >= expected
        await asyncio.sleep(POLL_S)
    return outputs, True


def _got(read: int, outputs: Sequence[OutputEvent], expected: int, pieces: int) -> bool:
    """Whether ``expected`` outputs as read (``read`` of them so far) are in: more than
    that, or that many with a last one that is not a stream that may still grow (one
    is taken as ended once the outputs are as many as the recording's ``pieces``)."""
    if read != expected:
        return read > expected
    return not outputs or outputs[-1].kind not in STREAMED or len(outputs) >= pieces > 0


async def replay_session(
    bus: RedisBus,
    pipeline: PipelineConfig,
    source: str,
    target: str,
    *,
    pace: Pace = "fast",
    speed: float = 1.0,
    progress: ProgressFn | None = None,
    wait_timeout_s: float = 120.0,
    quiet_s: float = 5.0,
    close_target: bool = True,
    closed_ttl_s: int = 3600,
    sleep: SleepFn = asyncio.sleep,
    greedy: bool = False,
    reference: str | None = None,
) -> ReplayReport:
    """Replay ``source``'s input log into the new session ``target`` under
    ``pipeline`` and compare the target's outputs with ``reference``'s (default: the
    source's); ``greedy``: the target's model stages decode greedily. See the module
    docstring."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    began = time.monotonic()
    sk = bus.keys.session(source)
    total = await bus.xlen(sk.input)
    end = await bus.last_id(sk.input)
    if end is None and await session_meta.status(bus, source) is None:
        raise SessionNotFoundError(f"no session {source!r} to replay")
    if await session_meta.status(bus, target) is not None:
        # Opening a closed id would reopen it and wipe what it recorded.
        raise SessionExistsError(f"replay target {target!r} exists; replay needs a new session id")
    records = await client_records(bus, reference or source)
    recorded = [event for _, event in records]
    source_greedy = await recorded_greedily(bus, source)
    authority = SessionAuthority(bus, pipeline)
    await _open_target(authority, bus, source, target, greedy)
    # Each input waits for the answers the source had given before it (replay_wait).
    source_records = records if reference is None else await client_records(bus, source)
    turns = TurnWaiter(bus, target, source_records,
                       [stage.name for stage in pipeline.stages], wait_timeout_s)  # fmt: skip
    done = skipped = first_seq = 0
    previous_ts: int | None = None
    async for page in _input_pages(bus, sk.input, end or "+"):
        for entry in page:
            try:
                event: InputEvent = decode_input(entry.event)
            except WireDecodeError:
                skipped += 1
                continue
            await turns.before(entry.id)
            if pace == "recorded" and (delay := pace_delay(previous_ts, event.ts_ms, speed)):
                await sleep(delay)
            previous_ts = event.ts_ms
            first_seq = first_seq or event.seq
            payload = untraced(greedy_payload(event.payload) if greedy else event.payload)
            await authority.append(target, event.mode, payload)
            done += 1
            if progress is not None:
                progress(done + skipped, total)
    await turns.at_end()
    # A greedy replay of a sampled source answers otherwise: the source's count of
    # outputs says nothing of the target's, so the target runs until it is quiet.
    waits_quiet = greedy and reference is None and not source_greedy and bool(recorded)
    expected = None if waits_quiet else len(compared(recorded))
    responses = sum(o.kind is OutputKind.DONE for o in recorded) if waits_quiet else 0
    outputs, complete = await _wait_outputs(
        bus, target, expected, wait_timeout_s, quiet_s, responses=responses,
        pieces=sum(o.kind not in NOT_COMPARED for o in recorded),
    )  # fmt: skip
    comparison = compare_outputs(recorded, outputs)
    if close_target:
        await authority.close(target, reason="replay done", ttl_s=closed_ttl_s)
    return ReplayReport(
        source=source, target=target, pipeline=pipeline.name, pace=pace, speed=speed,
        inputs=done, skipped=skipped, first_seq=first_seq, complete=complete,
        comparison=comparison, elapsed_s=time.monotonic() - began, greedy=greedy,
        source_greedy=source_greedy, reference=reference or "",
    )  # fmt: skip


def again_target(target: str) -> str:
    """The default session id of a greedy replay's second target."""
    return f"{target}.again"


async def replay_greedily(
    bus: RedisBus,
    pipeline: PipelineConfig,
    source: str,
    target: str,
    *,
    again: str | None = None,
    progress: ProgressFn | None = None,
    **options: Any,
) -> ReplayReport:
    """A greedy replay of ``source`` into ``target``, judged as the module docstring
    says: against the source when it was greedy itself, else by a second greedy
    replay into ``again`` (default ``again_target(target)``) compared with the first.
    ``options`` are ``replay_session``'s."""
    first = await replay_session(
        bus, pipeline, source, target, greedy=True, progress=progress, **options
    )
    if first.source_greedy:
        return first
    second = await replay_session(
        bus, pipeline, source, again or again_target(target), greedy=True, reference=target,
        progress=progress, **options,
    )  # fmt: skip
    return replace(first, again=second)
