"""The ``minicpmo`` stage: MiniCPM-o 4.5 in duplex mode, served by vLLM's async engine.

Duplex flow. The session's prompt is a run of token ids that grows with the
session (``minicpmo_session.DuplexPrompt``; the oldest units leave it past
the prompt budget). Each unit input (``append_unit``,
``append_audio_chunk``, ``append_video_frame``) goes through the model
extension's ``plan_append``: its placeholder tokens (the budget of
``workers.extensions.budget``, plus the context reserve on the session's
first append) join the prompt. Then the model decides for the unit: one
short request over the whole prompt with the stage-0 sampling parameters
(``configure_sampling_params`` over this stage's defaults and the duplex
options; with temperature 0 for a session whose settings say ``greedy``),
streamed step by step. Each step is shown to ``decide_output`` as
an output view: the step's own token ids, text, stop and finish reasons,
and ``special_token_ids`` naming the listen token. A listen decision is
published as a ``listen`` draft and ends the unit; speech is a ``speak``
draft followed by ``text_delta`` drafts (all ``flush=True``, with the
request id in ``meta``). The tokens the model produced for the unit (its
speech, its listen token) join the prompt, so the next unit is decided in
the context the user heard. Text and token inputs join the prompt without
a decision; a ``turn_commit_only`` is answered with ``done``.

Requests. Each unit's request id comes from the fence codec:
``make_request_id(fence, "<stage>-u<unit seq>-r<n>")``, ``n`` counting this
backend's requests so an id is never reused in the engine.

Interruption. ``release(ctx, fence)`` aborts every request the session has
in flight, and any other the engine still tracks, whose id decodes to the
released (incarnation, epoch) or an earlier one (``vllm_history.released_by``,
the ``vllm`` stage's rule); what the unit had produced so far stays in the
prompt. A cancelled producer task aborts its request too (the engine stream's
``finally``). Inputs accepted before the interruption are ``absorb``ed: their
placeholders join the prompt, nothing is decided for them.

Failover. ``start(ctx, inputs, outputs)`` keeps the recorded inputs and this
stage's accepted outputs; once the engine (and so the tokenizer) is ready,
the prompt is rebuilt from them (``minicpmo_session.rebuild``). A unit the
previous owner had answered but not finished applying is delivered again;
its published answer is carried into the prompt and it is not decided twice.

Multimodal data. Each unit's media (``minicpmo_media``: frames as PIL
images, audio as float32 arrays at 16 kHz) is decoded when it joins the
prompt and kept with its segment; every request carries the media of the
segments still in the prompt as vLLM's ``multi_modal_data``, in prompt
order, and each unit's run of placeholders goes to the engine as the
model's per-item markers (``image_marker``, ``audio_marker``), which vLLM
expands (``minicpmo_media.engine_prompt``). Only for a multimodal model
(``send_media``; by default what vLLM's model config says): the tiny text
model of the duplex tests takes the placeholder runs as they are. Whether
vLLM's MiniCPM-o processor expands each item to exactly the budget (66
tokens per image block, 12 per second of audio) is checked on a GPU only
(``bench/gpu_minicpmo_media.py``).

Options: see ``minicpmo_options.MiniCPMOOptions``. The pure rules live in
``minicpmo_session``; the engine (the ``vllm`` stage's, taking caller-built
sampling parameters) and the output views in ``minicpmo_engine``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dataplane.request_ids import make_request_id
from schemas.errors import InvalidInputError
from schemas.events import InputEvent, OutputEvent, OutputKind, SettingsPayload
from schemas.fence import Fence
from workers.backends.base import BackendError, OutputDraft, RebuildWindow, StageContext, StageEvent
from workers.backends.engine_stage import EngineStage
from workers.backends.minicpmo_engine import (
    CompletionView,
    DuplexStep,
    MiniCPMOEngine,
    OutputView,
    token_lookup,
)
from workers.backends.minicpmo_media import (
    NO_MEDIA,
    UnitMedia,
    engine_prompt,
    multi_modal_data,
    unit_media,
)
from workers.backends.minicpmo_options import MiniCPMOOptions, parse_minicpmo_options
from workers.backends.minicpmo_session import (
    Contribution,
    DuplexPrompt,
    PromptTooLong,
    UnitTurn,
    classify,
    rebuild,
)
from workers.backends.vllm_engine import request_seed
from workers.backends.vllm_history import released_by
from workers.extensions.base import (
    AppendPlan,
    CheckedExtension,
    copy_sampling_params,
    load_extension,
)
from workers.extensions.minicpmo import LISTEN_TOKEN, MiniCPMOTokenIds

log = logging.getLogger("duplexq.worker.minicpmo")

STATE_KEY = "minicpmo"
RECORDS_KEPT = 256
EXTENSION = "minicpmo45"
SPEAK_TOKEN = "<|speak|>"


# -- the backend ----------------------------------------------------------------------


def seeded(params: Any, request_id: str) -> Any:
    """``params`` with the request's own seed (``vllm_engine.request_seed``) when they fix
    none: a seedless engine draws from one generator seeded at start, so every fresh
    stack would sample a session's first answer the same way."""
    if getattr(params, "seed", 0) is not None:
        return params
    return copy_sampling_params(params, {"seed": request_seed(request_id)})


@dataclass(frozen=True, slots=True)
class Duplex:
    """What the stage resolves once the engine (and its tokenizer) is ready."""

    extension: CheckedExtension
    token_ids: MiniCPMOTokenIds
    special_token_ids: Mapping[str, int]
    params: Any
    """The stage-0 sampling parameters."""
    prompt_budget: int
    send_media: bool = False
    """Whether requests carry the units' media (the model takes ``multi_modal_data``)."""
    image_marker: tuple[int, ...] = ()
    audio_marker: tuple[int, ...] = ()
    """The token ids of the options' markers (with ``send_media``)."""
    greedy_params: Any = None
    """``params`` decoding greedily (temperature 0), for a session whose settings say
    ``greedy`` (a greedy replay); None: ``params`` are used."""

    def params_for(self, settings: SettingsPayload, request_id: str) -> Any:
        """The stage-0 sampling parameters of one request of a session with ``settings``:
        with the request's own seed when the stage fixes none (``seeded``)."""
        if settings.greedy and self.greedy_params is not None:
            return self.greedy_params
        return seeded(self.params, request_id)

    def engine_prompt(self, prompt: DuplexPrompt) -> tuple[int, ...]:
        """What the engine gets for ``prompt``: markers in place of placeholder runs."""
        if not self.send_media:
            return tuple(prompt.tokens())
        return tuple(
            engine_prompt(
                prompt.prefix, prompt.segments, prompt.media, self.image_marker, self.audio_marker
            )
        )

    def view(self, step: DuplexStep) -> OutputView:
        completion = CompletionView(step.token_ids, step.text, step.stop_reason, step.finish_reason)
        return OutputView((completion,), self.special_token_ids)


@dataclass
class DuplexSession:
    """A session's state in this backend (kept in ``StageContext.state``)."""

    prompt: DuplexPrompt = field(default_factory=DuplexPrompt)
    live: dict[str, UnitTurn] = field(default_factory=dict)
    """Units being decided, by request id."""
    replay: tuple[Sequence[StageEvent], Sequence[OutputEvent]] | None = None
    """Recorded inputs and outputs still to rebuild the prompt from (failover)."""
    carried: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Answers a previous owner published for units it had not finished applying."""

    def settle(self, request_id: str) -> UnitTurn | None:
        """End a live unit once: what it produced joins the prompt."""
        turn = self.live.pop(request_id, None)
        if turn is not None:
            self.prompt.answer(turn.produced)
        return turn


@dataclass
class UnitRecord:
    """What became of one unit's request (the newest ``RECORDS_KEPT`` are kept)."""

    request_id: str
    session_id: str
    prompt_token_ids: tuple[int, ...]
    outcome: str = "running"
    """``running``, ``finished:<reason>``, ``listen``, ``released``, ``cancelled`` or
    ``failed``."""
    decision: str = "none"
    """``listen``, ``speak`` or ``none``."""
    tokens: int = 0
    """Token ids published for the unit."""


class MiniCPMOStage(EngineStage[MiniCPMOEngine, UnitRecord]):
    """A ``StageBackend`` driving the MiniCPM-o duplex extension (module docstring)."""

    name = "minicpmo"
    continuous_input = False
    """Inputs accepted before a barge-in only join the prompt (``absorb``)."""
    follows_responses = True
    """Outputs answer the current response: a newer one supersedes them."""
    edits_conversation = False
    rebuild = RebuildWindow(resumes_answers=True)
    """The whole history; an answer cut by a failover is continued, not restarted."""

    def __init__(
        self,
        options: Mapping[str, Any],
        *,
        stage: str = "minicpmo",
        engine: MiniCPMOEngine | None = None,
    ) -> None:
        self.options: MiniCPMOOptions = parse_minicpmo_options(stage, options)
        super().__init__(
            engine or MiniCPMOEngine(self.options), owns_engine=engine is None,
            model=self.options.model, records_kept=RECORDS_KEPT,
        )  # fmt: skip
        self._duplex: Duplex | None = None
        self.last_prompts: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        """The prompt of each session's latest request (for logs and tests)."""

    # -- session lifecycle ---------------------------------------------------------------

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        own = [o for o in outputs if o.stage == ctx.stage]
        ctx.state[STATE_KEY] = DuplexSession(replay=(list(inputs), own) if inputs else None)
        # Not awaited: the engine may take long to start and the lease is only
        # renewed once start returns.
        self.engine.start_soon()

    async def stop(self, ctx: StageContext) -> None:
        session = ctx.state.pop(STATE_KEY, None)
        if isinstance(session, DuplexSession) and session.live:
            doomed = list(session.live)
            session.live.clear()
            await self.abort(doomed, "cancelled")

    def _session(self, ctx: StageContext) -> DuplexSession:
        session = ctx.state.get(STATE_KEY)
        if not isinstance(session, DuplexSession):
            session = ctx.state[STATE_KEY] = DuplexSession()
        return session

    # -- events ------------------------------------------------------------------------

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        session = self._session(ctx)
        contribution = classify(event)
        if contribution is Contribution.NOTHING:
            return
        assert isinstance(event, InputEvent)
        duplex = await self._ready(session)
        if contribution is not Contribution.COMMIT:
            self._append(duplex, session, event)
        carried = session.carried.pop(event.seq, None)
        if carried is not None:  # answered by the previous owner already
            session.prompt.answer(carried)
        elif contribution is Contribution.COMMIT:
            yield OutputDraft(OutputKind.DONE, meta={"finish_reason": "turn_commit"})
        elif contribution is Contribution.UNIT:
            async for draft in self._decide(ctx, duplex, session, event.seq):
                yield draft

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        """Context only: a unit's placeholders join the prompt, nothing is decided."""
        session = self._session(ctx)
        if classify(event) in (Contribution.UNIT, Contribution.CONTEXT):
            assert isinstance(event, InputEvent)
            self._append(await self._ready(session), session, event)
            session.prompt.answer(session.carried.pop(event.seq, ()))

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        self.released.append(fence)
        session = self._session(ctx)
        doomed = [rid for rid in session.live if released_by(rid, fence)]
        for request_id in doomed:
            session.settle(request_id)
        await self.abort_released(ctx.session_id, fence, doomed)

    def multi_modal_data(self, session: DuplexSession) -> Mapping[str, Any] | None:
        """The media behind the prompt's placeholders, as vLLM's ``multi_modal_data``.

        Each unit's frames under ``image`` (PIL images) and its audio under
        ``audio`` (float32 arrays at 16 kHz), in prompt order, for the segments
        still in the prompt; None when there is none or the model takes no media.
        """
        if self._duplex is None or not self._duplex.send_media:
            return None
        return multi_modal_data(session.prompt.media)

    # -- the duplex core's shell -------------------------------------------------------------

    async def _ready(self, session: DuplexSession) -> Duplex:
        """The resolved duplex setup; rebuilds the session's prompt after a failover."""
        duplex = self._duplex
        if duplex is None:
            llm = await self.engine.ready()
            duplex = self._duplex = self._resolve(self._takes_media(llm))
        if session.replay is not None:
            inputs, outputs = session.replay
            session.replay = None
            session.carried = rebuild(
                session.prompt,
                inputs,
                outputs,
                lambda e, first: self._replan(duplex, e, first),
                lambda e, plan: self._media(duplex, e, plan),
            )
        return duplex

    def _takes_media(self, llm: Any) -> bool:
        """``send_media``, or by default whether vLLM serves the model as multimodal."""
        if self.options.send_media is not None:
            return self.options.send_media
        model_config = getattr(llm, "model_config", None)
        return bool(getattr(model_config, "is_multimodal_model", False))

    def _resolve(self, send_media: bool) -> Duplex:
        """Token ids from the tokenizer, the extension and the stage-0 sampling parameters."""
        tokenizer: Any = self.engine.tokenizer
        lookup = token_lookup(tokenizer)
        try:
            token_ids = MiniCPMOTokenIds.from_token_lookup(lookup)
        except ValueError as exc:
            raise BackendError(f"{self.options.model}: {exc}") from exc
        special = {LISTEN_TOKEN: token_ids.listen_token_id, SPEAK_TOKEN: lookup(SPEAK_TOKEN)}
        special_ids = {name: value for name, value in special.items() if value is not None}
        if token_ids.listen_token_id is None:
            log.warning("%s has no %s token: it never listens", self.options.model, LISTEN_TOKEN)
        stops = [token_ids.listen_token_id] if self.options.listen_stops else []
        default = self.engine.sampling_params(
            max_tokens=self.options.max_tokens,
            temperature=self.options.temperature,
            top_p=self.options.top_p,
            seed=self.options.seed,
            stop_token_ids=[t for t in stops if t is not None],
            skip_special_tokens=True,
        )
        try:
            # Given the defaults, the extension's sampling answer is checked at load.
            extension = load_extension(
                EXTENSION,
                sampling_defaults=[default],
                token_ids=token_ids,
                context_reserve=self.options.context_reserve,
                tokenizer=self.engine.encode,
            )
            (params,) = extension.configure_sampling_params(
                [default], self.options.runtime_config()
            )
            greedy = copy_sampling_params(params, {"temperature": 0.0, "top_p": 1.0})
        except (TypeError, ValueError) as exc:
            raise BackendError(f"bad duplex sampling options: {exc}") from exc
        markers = (self.options.image_marker, self.options.audio_marker)
        image_marker, audio_marker = (tuple(self.engine.encode(m)) for m in markers)
        return Duplex(
            extension,
            token_ids,
            special_ids,
            params,
            self.options.prompt_budget,
            send_media,
            image_marker,
            audio_marker,
            greedy,
        )

    @staticmethod
    def _plan(duplex: Duplex, event: InputEvent, first_append: bool) -> AppendPlan:
        try:
            return duplex.extension.plan_append(
                event.fence, event.mode, event.payload, first_append=first_append
            )
        except (InvalidInputError, ValueError) as exc:  # an input the model cannot take
            raise BackendError(f"seq {event.seq}: {exc}") from exc

    @classmethod
    def _replan(cls, duplex: Duplex, event: InputEvent, first_append: bool) -> AppendPlan | None:
        """A recorded input's plan; None for one that failed when it was live too."""
        try:
            return cls._plan(duplex, event, first_append)
        except BackendError:
            return None

    def _append(self, duplex: Duplex, session: DuplexSession, event: InputEvent) -> None:
        plan = self._plan(duplex, event, session.prompt.first_append)
        session.prompt.add_plan(plan, self._media(duplex, event, plan))

    @staticmethod
    def _media(duplex: Duplex, event: InputEvent, plan: AppendPlan) -> UnitMedia:
        """The input's decoded media when requests carry media, else none."""
        if not duplex.send_media:
            return NO_MEDIA
        placeholders = plan.buffer.placeholder_count
        media = unit_media(event.payload, placeholders)
        for problem in media.problems:
            log.warning("seq %d: %s; dropped from the request's media", event.seq, problem)
        return media

    async def _decide(
        self, ctx: StageContext, duplex: Duplex, session: DuplexSession, seq: int
    ) -> AsyncIterator[OutputDraft]:
        """One request over the whole prompt; its decisions become drafts."""
        try:
            dropped = session.prompt.fit(duplex.prompt_budget)
        except PromptTooLong as exc:
            raise BackendError(str(exc)) from exc
        if dropped:
            log.info("session %s: %d old prompt segments dropped", ctx.session_id, dropped)
        prompt = tuple(session.prompt.tokens())
        request_id = make_request_id(ctx.fence, f"{ctx.stage}-u{seq}-r{self.next_number()}")
        turn = session.live[request_id] = UnitTurn(request_id, seq)
        record = self.records.add(UnitRecord(request_id, ctx.session_id, prompt))
        self._remember(ctx.session_id, prompt)
        finish: str | None = None
        try:
            data = self.multi_modal_data(session)
            sent = duplex.engine_prompt(session.prompt)
            async for step in self.engine.stream(
                sent, duplex.params_for(ctx.session, request_id), request_id, data
            ):
                if request_id not in session.live or step.finish_reason == "abort":
                    break  # released meanwhile: nothing more for this unit
                emissions = turn.read(duplex.extension.decide_output(duplex.view(step)))
                if step.finish_reason is not None or turn.ended:
                    emissions += turn.finish()
                    finish = "listen" if turn.ended else f"finished:{step.finish_reason}"
                record.decision, record.tokens = turn.decision, len(turn.produced)
                for emission in emissions:
                    yield OutputDraft(
                        emission.kind,
                        text=emission.text,
                        token_ids=emission.token_ids,
                        meta={"request_id": request_id},
                        flush=True,
                    )
                if finish is not None:
                    break
        except BackendError:
            record.outcome = "failed"
            raise
        finally:
            session.settle(request_id)
            if record.outcome == "running":
                record.outcome = finish or "cancelled"

    # -- bookkeeping -----------------------------------------------------------------------

    def _remember(self, session_id: str, prompt: tuple[int, ...]) -> None:
        self.last_prompts[session_id] = prompt
        self.last_prompts.move_to_end(session_id)
        while len(self.last_prompts) > RECORDS_KEPT:
            self.last_prompts.popitem(last=False)
