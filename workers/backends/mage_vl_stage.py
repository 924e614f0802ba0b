"""The ``mage_vl`` stage: the Mage-VL adapter, its model calls served by vLLM.

Wiring. One ``MageVLAdapter`` serves every session of the stage (its state is
keyed by session id); its two injected calls run on the worker's one vLLM
engine (``VllmEngine``):

- ``gate(session_id, windows)`` renders a prompt describing the latest
  windows, generates at most ``gate_max_tokens`` and turns the text into a
  ``GateDecision`` (``mage_vl_core.verdict``), tied to an event so that one
  event is spoken once;
- ``generate(session_id, windows, query, decision)`` renders an answer prompt
  (when a question is pending) or else a remark prompt (voicing the gate's
  decision) over the latest ``window_size`` windows and streams at most
  ``generate_max_tokens``; a question and a pending decision are answered by
  this one call.

Each session gets an ``AdapterRuntime`` whose sink turns chunks into drafts
(``mage_vl_core.to_draft``) and hands them to ``ctx.emit``: answers and
proactive remarks alike are produced by the runtime's response tasks, between
and during inputs, so ``handle`` only feeds the runtime and returns; frames
keep flowing (and gates keep running) while an answer streams, and a new
question supersedes the answer in flight.

Inputs. A video frame (``append_video_frame``, or a unit's video) becomes a
window (``mage_vl_core.make_window``); text accumulates as the next question;
a turn commit puts the question to the adapter (it is answered once a window
exists), or, with no question pending, is answered by a ``done`` alone
(``finish_reason: nothing_to_answer``). Answering at the commit, not at the
text, is what ties the answer to the response the commit reserved: an output
stamped with the fence before the reservation would be refused as stale.

Requests. Every engine call has an id from the fence codec,
``make_request_id(ctx.fence, "<stage>-<gate|answer|remark>-<n>")`` (``n``
counts the backend's requests), so which session and epoch a request serves
is read by decoding it. ``records`` keeps the newest requests (prompt, text,
outcome) for logs and tests.

Interruption. ``release(ctx, fence)`` barges in on the session's runtime: the
response in flight is cancelled, the pending decision and question are
dropped and the gate tasks are cancelled; cancelled calls abort their engine
requests, and any request of the session still tracked whose id decodes to
the released epoch or an earlier one is aborted before ``release`` returns.
The runtime's work is bound to the epoch it started in (``MageSession.epoch``):
from the moment the serving fence moves to a newer epoch until the barge-in
is through, the sink publishes nothing, so no chunk of the old epoch goes out
stamped with the new fence. An input of a newer epoch that reaches ``handle``
before its cancel does triggers the same barge-in.

Close and failover. ``stop`` closes the runtime without speaking what is
pending: once a session stops the worker publishes nothing more for it, so
voicing a pending decision would only spend engine time. ``start`` rebuilds
which events were already spoken from the stage's published ``done`` outputs
(so a new owner does not repeat them); windows are not replayed, the gate
resumes once ``window_size`` new windows arrived.

Frames. With ``image_placeholder`` set, prompts carry one placeholder per
frame of each described window and the request carries those frames as
images (``mage_vl_media``); vLLM's processor for the model turns each into
the model's image tokens. Such requests go through the engine's
multimodal ``stream`` (``MiniCPMOEngine``, the default engine: the ``vllm``
stage's engine taking caller-built sampling parameters and
``multi_modal_data``). Without it the prompts describe windows in text only,
which is what a text model (the tiny test model) takes. A checkpoint whose
code transformers does not ship needs ``trust_remote_code = true``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dataplane.request_ids import belongs_to_session, make_request_id
from schemas.events import OutputEvent, OutputKind, VideoPayload
from schemas.fence import Fence
from workers.adapters.base import OutputChunk
from workers.adapters.mage_vl import MageVLAdapter
from workers.adapters.mage_vl_types import GateDecision, VisualWindow
from workers.adapters.runtime import AdapterRuntime, OutputSink
from workers.backends.base import ALL_HISTORY, BackendError, OutputDraft, StageContext, StageEvent
from workers.backends.engine_stage import EngineStage
from workers.backends.mage_vl_core import (
    Kind,
    MageVLOptions,
    PromptBuilder,
    Speaking,
    answer_builder,
    classify,
    describe_all,
    fit_lines,
    gate_builder,
    make_window,
    parse_options,
    remark_builder,
    to_draft,
    verdict,
)
from workers.backends.mage_vl_media import image_data, with_placeholders
from workers.backends.minicpmo_engine import DuplexStep, MiniCPMOEngine
from workers.backends.vllm_engine import EngineStep, SamplingSpec, VllmEngine, sampling_spec
from workers.backends.vllm_history import ChatMessages, released_by

log = logging.getLogger("duplexq.worker.mage_vl")

STATE_KEY = "mage_vl"
RECORDS_KEPT = 512
MAX_QUERY_CHARS = 16_000
"""Most characters of text a session gathers for its next question (oldest dropped)."""
Purpose = Literal["gate", "answer", "remark"]


@dataclass
class RequestRecord:
    """What became of one engine request (the newest ``RECORDS_KEPT`` are kept)."""

    request_id: str
    session_id: str
    purpose: Purpose
    prompt: str
    windows: int
    """How many windows the prompt described (the oldest go first when it is too long)."""
    outcome: str = "running"
    """``running``, ``finished:<reason>``, ``released``, ``cancelled`` or ``failed``."""
    text: str = ""
    tokens: int = 0


@dataclass
class MageSession:
    """One session's shell state (also kept in ``StageContext.state``)."""

    ctx: StageContext
    epoch: int
    """The epoch the runtime's work belongs to; chunks are published only while the
    serving fence is still at this epoch."""
    runtime: AdapterRuntime = field(init=False)
    """Drives the adapter for this session; built right after the session (its sink
    needs the session)."""
    query_parts: list[str] = field(default_factory=list)
    """Text received since the last commit: the next question."""
    spoken_before: set[str] = field(default_factory=set)
    """Events a previous owner already spoke (rebuilt on failover)."""
    live: set[str] = field(default_factory=set)
    """Engine requests of this session now running."""
    speaking: Speaking | None = None
    """The request voicing the latest answer or remark; its drafts name it."""
    outbox: list[OutputDraft] = field(default_factory=list)
    """Drafts kept for the next ``handle`` when the context has no ``emit``."""

    @property
    def session_id(self) -> str:
        return self.ctx.session_id


class MageVLStage(EngineStage[VllmEngine, RequestRecord]):
    """A ``StageBackend`` running the Mage-VL adapter on a vLLM engine (see module docs)."""

    name = "mage_vl"
    continuous_input = False
    """Frames and text accepted before a barge-in are absorbed: context, no answer."""
    follows_responses = True
    """Outputs are responses (answers, remarks): a newer response supersedes them."""
    edits_conversation = False
    rebuild = ALL_HISTORY

    def __init__(
        self,
        options: Mapping[str, Any],
        *,
        stage: str = "mage_vl",
        engine: VllmEngine | None = None,
    ) -> None:
        config = parse_options(stage, options)
        self.stage = stage
        self.options: MageVLOptions = config.stage
        self.engine_options = config.engine
        super().__init__(
            engine or MiniCPMOEngine(config.engine), owns_engine=engine is None,
            model=config.engine.model, records_kept=RECORDS_KEPT,
        )  # fmt: skip
        self.adapter = MageVLAdapter(
            self._gate,
            self._generate,
            window_size=self.options.window_size,
            max_windows=self.options.max_windows,
            max_gate_tasks=self.options.max_gate_tasks,
            hold_decisions_while_responding=self.options.hold_decisions_while_responding,
        )
        self._sessions: dict[str, MageSession] = {}

    # -- session lifecycle -----------------------------------------------------------

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        spoken = {
            str(o.meta["event_id"])
            for o in outputs
            if o.stage == ctx.stage and o.kind is OutputKind.DONE and "event_id" in o.meta
        }
        await self._open(ctx, spoken)
        # Not awaited: the engine may take long to start and the session's lease is
        # only renewed once start returns.
        self.engine.start_soon()

    async def stop(self, ctx: StageContext) -> None:
        ctx.state.pop(STATE_KEY, None)
        session = self._sessions.get(ctx.session_id)
        if session is not None and session.ctx is ctx:
            await self._close(session)

    async def aclose(self) -> None:
        for session in list(self._sessions.values()):
            await self._close(session)
        await super().aclose()

    def session(self, session_id: str) -> MageSession | None:
        return self._sessions.get(session_id)

    async def _open(self, ctx: StageContext, spoken: set[str]) -> MageSession:
        previous = self._sessions.get(ctx.session_id)
        if previous is not None:
            await self._close(previous)
        session = MageSession(ctx, ctx.fence.epoch, spoken_before=spoken)
        session.runtime = AdapterRuntime(self.adapter, ctx.session_id, self._sink(session))
        ctx.state[STATE_KEY] = session
        self._sessions[ctx.session_id] = session
        await session.runtime.start()
        return session

    async def _close(self, session: MageSession) -> None:
        if self._sessions.get(session.session_id) is session:
            del self._sessions[session.session_id]
        await session.runtime.close(graceful=False)
        doomed = [
            rid
            for rid in session.live | self.engine.live_request_ids()
            if belongs_to_session(rid, session.session_id)
        ]
        await self.abort(doomed, "cancelled")

    async def _current(self, ctx: StageContext) -> MageSession:
        """The session's state, opened if need be, with older-epoch work released."""
        session = self._sessions.get(ctx.session_id)
        if session is None or session.ctx is not ctx:
            session = await self._open(ctx, set())
        if ctx.fence.epoch > session.epoch:
            # The data path is ahead of the cancel (or the cancel found nothing to
            # release): whatever the runtime does belongs to the older epoch.
            await self._release(session, ctx.fence.replace(epoch=ctx.fence.epoch - 1))
        return session

    # -- events ------------------------------------------------------------------------

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        session = await self._current(ctx)
        drafts, session.outbox = session.outbox, []
        for draft in drafts:
            yield draft
        item = classify(event)
        if item.kind is Kind.WINDOW:
            assert item.video is not None
            window = self._window(session, event, item.video)
            await session.runtime.push(window)
        elif item.kind is Kind.QUERY_PART:
            self._add_query_part(session, item.text)
        elif item.kind is Kind.COMMIT:
            query = "".join(session.query_parts).strip()
            session.query_parts.clear()
            if not query:
                yield OutputDraft(OutputKind.DONE, meta={"finish_reason": "nothing_to_answer"})
                return
            # The answer streams through the sink, from the runtime's response task.
            await session.runtime.push(query)

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        """Frames still update what the model sees; a commit asks for nothing."""
        session = await self._current(ctx)
        item = classify(event)
        if item.kind is Kind.WINDOW:
            assert item.video is not None
            try:
                window = self._window(session, event, item.video)
            except BackendError as exc:
                # Nothing answers an absorbed input, so there is no place for an error.
                log.warning("session %s: absorbed frame skipped: %s", ctx.session_id, exc)
                return
            await session.runtime.push(window)
        elif item.kind is Kind.QUERY_PART:
            self._add_query_part(session, item.text)
        elif item.kind is Kind.COMMIT:
            session.query_parts.clear()

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        self.released.append(fence)
        session = self._sessions.get(ctx.session_id)
        if session is not None:
            await self._release(session, fence)

    @staticmethod
    def _add_query_part(session: MageSession, text: str) -> None:
        session.query_parts.append(text)
        # A client that never commits must not grow the session without bound.
        while sum(map(len, session.query_parts)) > MAX_QUERY_CHARS and session.query_parts:
            session.query_parts.pop(0)

    def _window(self, session: MageSession, event: StageEvent, video: VideoPayload) -> VisualWindow:
        return make_window(
            video,
            seq=event.seq,
            session_id=session.session_id,
            segment_ms=self.options.segment_ms,
        )

    async def _release(self, session: MageSession, fence: Fence) -> None:
        doomed = [rid for rid in session.live if released_by(rid, fence)]
        self.records.note(doomed, "released")
        if fence.epoch >= session.epoch:
            # Otherwise the runtime already serves a later epoch than the released
            # one (an input of that epoch got here first): only stragglers go.
            await session.runtime.barge_in()
            session.epoch = max(session.epoch, session.ctx.fence.epoch)
        # Cancelled calls abort their own requests; abort whatever else is tracked.
        await self.abort_released(session.session_id, fence, doomed)

    # -- output ------------------------------------------------------------------------

    def _sink(self, session: MageSession) -> OutputSink:
        async def sink(chunk: OutputChunk) -> None:
            if session.ctx.fence.epoch != session.epoch:
                return  # released: the barge-in that ends this work is under way
            draft = to_draft(chunk, session.speaking)
            if session.ctx.emit is not None:
                session.ctx.emit(draft)
            else:
                session.outbox.append(draft)

        return sink

    # -- model calls (injected into the adapter) -----------------------------------------

    async def _gate(self, session_id: str, windows: tuple[VisualWindow, ...]) -> GateDecision:
        session = self._sessions.get(session_id)
        if session is None:
            return GateDecision(respond=False)
        builder = gate_builder(self.options, None)
        stream = self._stream(session, "gate", builder, windows, self.options.gate_max_tokens)
        async with contextlib.aclosing(stream) as pieces:
            text = "".join([piece async for piece in pieces])
        decision = verdict(self.options, text, windows)
        if decision.event_id is not None and decision.event_id in session.spoken_before:
            return GateDecision(respond=False, metadata=decision.metadata)
        return decision

    async def _generate(
        self,
        session_id: str,
        windows: tuple[VisualWindow, ...],
        query: str | None,
        decision: GateDecision | None,
    ) -> AsyncGenerator[str, None]:
        session = self._sessions.get(session_id)
        if session is None:
            raise BackendError(f"Mage-VL session {session_id!r} is not served by this stage")
        # One call answers both: a question is answered (the pending remark's moment
        # is in the same windows), else the decision is voiced.
        if query is not None:
            purpose: Purpose = "answer"
            builder = answer_builder(self.options, query)
        elif decision is not None:
            purpose = "remark"
            builder = remark_builder(self.options, decision)
        else:
            return
        stream = self._stream(session, purpose, builder, windows, self.options.generate_max_tokens)
        async with contextlib.aclosing(stream) as pieces:
            async for piece in pieces:
                yield piece

    def _engine_prompt(
        self, builder: PromptBuilder, windows: Sequence[VisualWindow], max_tokens: int
    ) -> tuple[str, list[int], int, dict[str, Any] | None]:
        """Prompt text, token ids, how many windows it describes and their frames.

        The frames (vLLM's ``multi_modal_data``) come only with an
        ``image_placeholder``: they are those of the described windows, the newest
        ``kept``, in the order of their placeholders.
        """
        budget = self.engine_options.max_model_len - max_tokens
        lines = describe_all(windows)
        placeholder = self.options.image_placeholder
        if placeholder is not None:
            lines = with_placeholders(lines, windows, placeholder)
        chat, kept = fit_lines(builder, lines, self._counter(), budget)
        prompt = self.engine.render(chat)
        described = windows[len(windows) - kept :]
        data = image_data(described) if placeholder is not None else None
        return prompt, self.engine.encode(prompt), kept, data

    def _counter(self) -> Callable[[ChatMessages], int]:
        """Prompt tokens of a chat, each frame counted at ``frame_tokens`` once expanded."""
        placeholder, extra = self.options.image_placeholder, self.options.frame_tokens
        if placeholder is None or not extra:
            return self.engine.count

        def count(chat: ChatMessages) -> int:
            frames = sum(str(message.get("content", "")).count(placeholder) for message in chat)
            return self.engine.count(chat) + frames * extra

        return count

    def _steps(
        self, prompt_ids: list[int], spec: SamplingSpec, request_id: str, data: Any
    ) -> AsyncIterator[EngineStep | DuplexStep]:
        """The engine's steps for one request, with its frames when it has any."""
        if data is None:
            return self.engine.generate(prompt_ids, spec, request_id)
        if not isinstance(self.engine, MiniCPMOEngine):
            raise BackendError("image_placeholder is set but the engine takes no images")
        params = self.engine.sampling_params(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            seed=spec.seed,
            skip_special_tokens=True,
        )
        return self.engine.stream(prompt_ids, params, request_id, data)

    async def _stream(
        self,
        session: MageSession,
        purpose: Purpose,
        builder: PromptBuilder,
        windows: Sequence[VisualWindow],
        max_tokens: int,
    ) -> AsyncGenerator[str, None]:
        """One engine request: its text pieces; however it ends, it leaves the engine."""
        await self.engine.ready()
        prompt, prompt_ids, kept, data = self._engine_prompt(builder, windows, max_tokens)
        role = f"{self.stage}-{purpose}-{self.next_number()}"
        request_id = make_request_id(session.ctx.fence, role)
        record = self.records.add(
            RequestRecord(request_id, session.session_id, purpose, prompt, kept)
        )
        if purpose != "gate":
            session.speaking = Speaking(request_id, "query" if purpose == "answer" else "gate")
        spec = sampling_spec(self.engine_options, session.ctx.session, request_id, max_tokens)
        session.live.add(request_id)
        finish: str | None = None
        try:
            async for step in self._steps(prompt_ids, spec, request_id, data):
                if step.finish_reason == "abort":
                    break
                if step.text:
                    record.text += step.text
                    record.tokens += len(step.token_ids)
                    yield step.text
                finish = step.finish_reason
        except BackendError:
            record.outcome = "failed"
            raise
        finally:
            session.live.discard(request_id)
            if record.outcome == "running":
                record.outcome = "cancelled" if finish is None else f"finished:{finish}"

    # -- bookkeeping -----------------------------------------------------------------------
