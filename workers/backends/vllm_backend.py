"""The ``vllm`` stage: a text chat model served by vLLM's async engine.

Chat flow. Text and token inputs of the session log (or an upstream stage's
text deltas and transcripts) accumulate as the user's message; a turn commit
(``turn_commit_only``, or an upstream ``done``) closes it and starts a
response. The prompt is the session's history rendered with the tokenizer's
chat template; tokens stream out as ``text_delta`` drafts (``flush=True``,
with their token ids and the request id in ``meta``), then one ``done``
draft with the finish reason. A commit with nothing new to answer gets a
``done`` alone (``finish_reason: nothing_to_answer``). Audio and video are
not for a text model and are skipped.

Requests. Each response is one engine request whose id comes from the fence
codec: ``make_request_id(fence, "<stage>-t<turn>-r<n>")`` where ``turn``
counts the session's commits and ``n`` this backend's requests, so an id is
never reused in the engine.

Interruption. ``release(ctx, fence)`` (barge-in, ``response.cancel``) aborts
every request of the session the engine still tracks whose id decodes to the
released (incarnation, epoch) or an earlier one, and cuts the response in the
history at what was produced: the deltas already handed to the worker. (The
worker drops deltas still queued when the fence moves, so at most those few
tokens differ from what the user got; a failover rebuild uses the published
outputs exactly.) The runtime also cancels the task generating the response;
that cancellation aborts the request too. Either way nothing more is yielded
for it, and it is gone from the engine before ``release`` returns.

Failover. ``start(ctx, inputs, outputs)`` rebuilds the history from the
recorded inputs and this stage's own accepted outputs, so the new owner
continues with the context the user heard. A response the previous owner was
still streaming is continued after its delivered deltas rather than redone.

History bounds (policy). The stored history keeps the newest
``history_max_messages`` messages (default 32). Each prompt keeps the
system prompt (the session's ``instructions`` when its client set them, else
the stage's ``system_prompt``) and then as many of the newest exchanges as fit
``history_max_tokens`` (default ``max_model_len - max_tokens``); the oldest
go first, whole, so the prompt starts with a user message. A user message
too long to fit alone is answered with an error and dropped from the history.

Sampling. Each response samples with the stage's ``temperature``, ``top_p`` and
``seed``, or without a ``seed`` with one drawn from its request id
(``request_seed``: no two requests share a sample); a session whose settings say
``greedy`` (a greedy replay) gets temperature 0 instead, so its answers depend on its
history alone (``sampling_spec``). A response
generates at most ``max_tokens``, or the session's ``max_output_tokens`` where that is
less (``response_max_tokens``).

Options: see ``vllm_options.VllmOptions`` (model, dtype, max_model_len,
gpu_memory_utilization, kv_cache_memory_bytes, enforce_eager, seed,
max_tokens, temperature, top_p, system_prompt, history_max_messages,
history_max_tokens). The pure rules live in ``vllm_history``; the engine
wrapper in ``vllm_engine``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dataplane.request_ids import make_request_id
from schemas.events import ConversationPayload, OutputEvent, OutputKind
from schemas.fence import Fence
from schemas.items import response_item
from workers.backends.base import BackendError, OutputDraft, RebuildWindow, StageContext, StageEvent
from workers.backends.engine_stage import EngineStage
from workers.backends.vllm_engine import EngineStep, VllmEngine, response_max_tokens, sampling_spec
from workers.backends.vllm_history import (
    ChatHistory,
    Contribution,
    Produced,
    PromptTooLong,
    Response,
    asks_response,
    classify,
    edit_of,
    item_of,
    rebuild,
    released_by,
)
from workers.backends.vllm_options import VllmOptions, parse_options
from workers.backends.vllm_response import ResponseSpec, context_chat, spec_of
from workers.backends.vllm_tools import (
    CALL_TAG,
    Call,
    CallGate,
    ToolPlan,
    call_id,
    forced_calls,
    plan_for,
)

log = logging.getLogger("duplexq.worker.vllm")

STATE_KEY = "vllm"
RECORDS_KEPT = 256


@dataclass
class SessionChat:
    """A session's state in this backend (kept in ``StageContext.state``)."""

    history: ChatHistory
    live: dict[str, Response] = field(default_factory=dict)
    """Responses being generated, by request id."""
    last_prompt: str = ""
    """The prompt text of the latest request (for logs and tests)."""

    def settle(self, request_id: str) -> Response | None:
        """End a live response once: its produced text and calls join the history."""
        response = self.live.pop(request_id, None)
        if response is not None and response.kept:
            self.history.add_assistant(response.produced, response.item, response.calls)
        return response

    def edit(self, edit: ConversationPayload) -> None:
        self.history.edit(edit)


@dataclass
class RequestRecord:
    """What became of one engine request (the newest ``RECORDS_KEPT`` are kept)."""

    request_id: str
    session_id: str
    prompt: str
    outcome: str = "running"
    """``running``, ``finished:<reason>``, ``released``, ``cancelled`` or ``failed``."""
    tokens: int = 0


class VllmBackend(EngineStage[VllmEngine, RequestRecord]):
    """A ``StageBackend`` over one vLLM engine (see the module docstring)."""

    name = "vllm"
    continuous_input = False
    """Inputs accepted before a barge-in only join the context (``absorb``)."""
    follows_responses = True
    """Outputs are a response: a newer response supersedes them."""
    rebuild = RebuildWindow(resumes_answers=True)
    """The whole history; an answer cut by a failover is continued, not restarted."""
    edits_conversation = True
    """Items added, deleted or cut by the client change the history (``vllm_history``)."""

    def __init__(
        self,
        options: Mapping[str, Any],
        *,
        stage: str = "vllm",
        engine: VllmEngine | None = None,
    ) -> None:
        self.options: VllmOptions = parse_options(stage, options)
        super().__init__(
            engine or VllmEngine(self.options), owns_engine=engine is None,
            model=self.options.model, records_kept=RECORDS_KEPT,
        )  # fmt: skip

    # -- session lifecycle -----------------------------------------------------------

    async def start(
        self, ctx: StageContext, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
    ) -> None:
        history = ChatHistory(self.options.history_max_messages)
        pending = rebuild(history, inputs, [o for o in outputs if o.stage == ctx.stage])
        if pending is not None:
            ctx.next_response = pending  # a response.create's options not yet taken
        ctx.state[STATE_KEY] = SessionChat(history)
        # Started by ``load`` already in a worker; not awaited here (an engine given
        # no ``load`` may take long to start, and the lease is only renewed once
        # start returns).
        self.engine.start_soon()

    async def stop(self, ctx: StageContext) -> None:
        chat = ctx.state.pop(STATE_KEY, None)
        if isinstance(chat, SessionChat) and chat.live:
            doomed = list(chat.live)
            chat.live.clear()
            await self.abort(doomed, "cancelled")

    def _chat(self, ctx: StageContext) -> SessionChat:
        chat = ctx.state.get(STATE_KEY)
        if not isinstance(chat, SessionChat):
            chat = ctx.state[STATE_KEY] = SessionChat(
                ChatHistory(self.options.history_max_messages)
            )
        return chat

    # -- events ------------------------------------------------------------------------

    async def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]:
        chat = self._chat(ctx)
        contribution, part = classify(event)
        if contribution is Contribution.USER_PART:
            chat.history.add_user(part, item_of(event))
        elif contribution is Contribution.COMMIT:
            carried = chat.history.close_user(event.seq)
            produced = carried[0] if carried else Produced()
            asked = asks_response(event)
            async for draft in self._respond(ctx, chat, event.seq, produced, asked=asked):
                yield draft
        elif contribution is Contribution.EDIT:
            chat.edit(edit_of(event))

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None:
        """Context only: a commit closes the user's message but asks for nothing; a
        client's edit of the conversation changes the history."""
        chat = self._chat(ctx)
        contribution, part = classify(event)
        if contribution is Contribution.USER_PART:
            chat.history.add_user(part, item_of(event))
        elif contribution is Contribution.COMMIT:
            carried = chat.history.close_user(event.seq)
            if carried is not None:
                chat.history.add_assistant(*carried)
        elif contribution is Contribution.EDIT:
            chat.edit(edit_of(event))

    async def release(self, ctx: StageContext, fence: Fence) -> None:
        self.released.append(fence)
        chat = self._chat(ctx)
        doomed = [rid for rid in chat.live if released_by(rid, fence)]
        for request_id in doomed:
            chat.settle(request_id)
        await self.abort_released(ctx.session_id, fence, doomed)

    # -- responses -----------------------------------------------------------------------

    async def _respond(
        self, ctx: StageContext, chat: SessionChat, seq: int, carried: Produced, *,
        asked: bool = False,
    ) -> AsyncIterator[OutputDraft]:  # fmt: skip
        """Answer a commit: the user's turn, a function's result, or (``asked``: a
        ``response.create``) whatever the conversation holds."""
        wanted = spec_of(ctx.next_response)
        max_tokens = response_max_tokens(self.options, ctx.session) - len(carried.token_ids)
        ended = _ended_early(chat, asked=asked, max_tokens=max_tokens)
        if ended is not None:
            if ended == "length" and not wanted.out_of_band:  # the previous owner's, whole
                chat.history.add_assistant(carried, response_item(ctx.fence))
            yield OutputDraft(OutputKind.DONE, meta={"finish_reason": ended})
            return
        plan = plan_for(ctx.session, ctx.next_response)
        ctx.next_response = None  # it was for this response only
        instructions = wanted.instructions or ctx.session.instructions
        prompt_ids = await self._prompt(chat, carried, instructions, plan, wanted)
        role = f"{ctx.stage}-t{chat.history.turns}-r{self.next_number()}"
        request_id = make_request_id(ctx.fence, role)
        item = response_item(ctx.fence)
        response = chat.live[request_id] = Response(request_id, seq, item, carried)
        response.kept = not wanted.out_of_band
        record = self.records.add(RequestRecord(request_id, ctx.session_id, chat.last_prompt))
        spec = sampling_spec(self.options, ctx.session, request_id, max_tokens, plan.schema())
        gate = CallGate() if plan.active else None
        finish: str | None = None
        try:
            async for step in self.engine.generate(prompt_ids, spec, request_id):
                if request_id not in chat.live or step.finish_reason == "abort":
                    break  # released meanwhile: nothing more for this request
                finish = step.finish_reason
                if not (step.text or step.token_ids):
                    continue
                record.tokens += len(step.token_ids)
                for ready in _streamable(plan, gate, step):
                    yield self._delta(response, ready, request_id)
            if finish is not None and gate is not None and request_id in chat.live:
                for draft in self._answer_end(plan, gate, ctx, response, request_id):
                    yield draft
        except BackendError:
            record.outcome = "failed"
            raise
        finally:
            settled = chat.settle(request_id)
            if record.outcome == "running":
                record.outcome = "cancelled" if finish is None else f"finished:{finish}"
        if finish is not None and settled is not None:
            yield OutputDraft(
                OutputKind.DONE,
                meta={"request_id": request_id, "finish_reason": finish, "tokens": record.tokens},
            )

    @staticmethod
    def _delta(response: Response, step: EngineStep, request_id: str) -> OutputDraft:
        """A text delta of the answer (it joins what the user got of the response)."""
        response.add(step.text, step.token_ids)
        return OutputDraft(OutputKind.TEXT_DELTA, text=step.text, token_ids=step.token_ids,
                           meta={"request_id": request_id}, flush=True)  # fmt: skip

    def _answer_end(
        self, plan: ToolPlan, gate: CallGate, ctx: StageContext, response: Response,
        request_id: str,
    ) -> list[OutputDraft]:  # fmt: skip
        """What an answer with tools ends with: its calls, or the text held back for a
        call tag that never came."""
        calls = self._calls(plan, gate, ctx)
        response.calls = [call.chat() for call in calls]
        drafts = [] if calls or plan.forced else [
            self._delta(response, ready, request_id) for ready in gate.flush()
        ]  # fmt: skip
        if calls and plan.forced is None:
            # Text before the tag that was held back with it (in the same step).
            said, before = "".join(response.text), gate.text.split(CALL_TAG, 1)[0]
            if len(before) > len(said) and before.startswith(said):
                step = EngineStep(before[len(said) :], (), None)
                drafts.append(self._delta(response, step, request_id))
        meta = [{"call_id": call.call_id, "name": call.name} for call in calls]
        return drafts + [
            OutputDraft(OutputKind.FUNCTION_CALL, text=call.arguments, meta=named)
            for call, named in zip(calls, meta, strict=True)
        ]

    def _calls(self, plan: ToolPlan, gate: CallGate, ctx: StageContext) -> list[Call]:
        """The function calls an answer made: its constrained JSON, or what vLLM's tool
        parser finds from the call tag on."""
        if plan.forced is not None:
            return forced_calls(plan, gate.text, ctx.fence)
        if not gate.calling:
            return []
        parsed = self.engine.parse_calls(self.options.tool_parser, gate.text, plan.tools)
        return [
            Call(call_id(ctx.fence, index), str(found.function.name),
                 str(found.function.arguments))
            for index, found in enumerate(getattr(parsed, "tool_calls", []) or [])
        ]  # fmt: skip

    async def _prompt(
        self, chat: SessionChat, carried: Produced, instructions: str, plan: ToolPlan,
        spec: ResponseSpec,
    ) -> list[int]:  # fmt: skip
        """Token ids of the next prompt: the fitted history (or the response's own input),
        then any carried deltas. The response's or the session's instructions replace the
        stage's system prompt."""
        await self.engine.ready()
        budget = self.options.prompt_budget - len(carried.token_ids)
        system = instructions or self.options.system_prompt or ""
        if spec.context is not None:
            messages = context_chat(spec, chat.history, self.engine.decode, system)
            if self.engine.count(messages) > budget:
                raise BackendError(f"the response's input does not fit {budget} prompt tokens")
        else:
            messages = self._fitted(chat, budget, system)
        text = self.engine.render(messages, plan.tools if plan.active else ())
        chat.last_prompt = text + carried.text
        return self.engine.encode(text) + list(carried.token_ids)

    def _fitted(self, chat: SessionChat, budget: int, system: str) -> list[dict[str, Any]]:
        """The newest history that fits ``budget``; a user message too long alone is
        dropped and answered with an error."""
        try:
            messages, _ = chat.history.fit(self.engine.decode, self.engine.count, budget, system)
        except PromptTooLong as exc:
            chat.history.drop_last_user()
            log.warning("%s: %s; the message is dropped", self.options.model, exc)
            raise BackendError(str(exc)) from exc
        return messages

    # -- bookkeeping -----------------------------------------------------------------------


def _ended_early(chat: SessionChat, *, asked: bool, max_tokens: int) -> str | None:
    """Why a commit gets no generation (its ``done``'s finish reason), or None: nothing
    to answer (a turn that added nothing, unless a ``response.create`` asked), or the
    answer a previous owner carried is already whole (``length``)."""
    if not (asked or chat.history.awaits_answer()):
        return "nothing_to_answer"
    if max_tokens <= 0:
        return "length"
    return None


def _streamable(plan: ToolPlan, gate: CallGate | None, step: EngineStep) -> list[EngineStep]:
    """The steps that stream now as text: all of them without tools, none of a forced
    call (JSON), and what the call gate lets through otherwise."""
    if gate is None:
        return [step]
    ready: list[EngineStep] = gate.feed(step, step.text)
    return [] if plan.forced is not None else ready
