"""The stage backend contract.

A backend turns one session's events into output drafts. The worker runtime
owns everything else: ordering, fences, leases, publishing and skipping what
was already applied. A backend only

- ``load``s its model, once, when the worker starts and before it takes any
  session (optional, ``LoadsModel``: a backend without ``load``, like echo,
  has nothing to load),
- ``start``s a session, optionally rebuilding its state from the session's
  recorded inputs and the outputs this stage already published (failover),
  as much of them as its ``rebuild`` window asks for,
- ``handle``s one event, yielding drafts as they are ready (a streaming model
  yields one per step; ``flush`` drafts are published as they come, coalesced:
  see ``workers.coalesce``); a backend that has an answer at once may give it
  from ``answer_now`` instead (optional, ``AnswersAtOnce``),
- ``absorb``s an event that arrived before an interruption (context only,
  nothing answers it) unless it declares ``continuous_input``,
- ``release``s the work bound to a fence (barge-in, close, failover): abort
  engine requests, stop synthesis,
- ``stop``s the session.

The runtime cancels the task running ``handle`` when the fence it serves is
released; a backend must let that CancelledError through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dataplane.readiness import StageModel
from dataplane.stage_fence import StageFence
from schemas.events import InputEvent, OutputEvent, OutputKind, SettingsPayload
from schemas.fence import Fence


class BackendError(Exception):
    """A recoverable failure while handling one event; the session goes on."""


@dataclass(slots=True, init=False)
class StageContext:
    """What a backend knows of the session it serves."""

    session_id: str
    stage: str
    stage_fence: StageFence
    """The fence the stage serves; only the runtime moves it, through its named
    transitions (``dataplane.stage_fence``). Backends read it as ``fence``."""
    options: Mapping[str, Any]
    state: dict[str, Any]
    """Backend-owned per-session state."""
    session: SettingsPayload
    """The session's settings as the client left them (``session.update``), kept
    current in log order by the runtime: a backend reads what it acts on (the
    instructions, the voice, whether audio is wanted, turn detection) when it uses it.
    Settings events never reach ``handle``, ``absorb`` or ``start``."""
    next_response: dict[str, str] | None
    """What a ``response.create`` named for the next response only (its ``tools`` and
    ``tool_choice``, as ``schemas.tools`` writes them), kept by the runtime until the
    backend that answers takes it (and sets it back to None)."""
    interrupt: Callable[[str], Awaitable[Fence]] | None
    """Barge in on the session (bump its epoch, as a client cancel does) with a reason;
    returns the new fence. Set by the runtime; a VAD hearing the user uses it."""
    end_turn: Callable[[], Awaitable[Fence]] | None
    """End the user's turn from inside the pipeline (a server VAD hearing the end of an
    utterance): reserves the model's turn and response as a client commit does and
    returns the new fence. Set by the runtime."""
    emit: Callable[[OutputDraft], None] | None
    """Publish a draft outside ``handle`` (a proactive stage speaking on its own, e.g.
    Mage-VL's gate firing between inputs), under the session's current fence. Set by
    the runtime; drafts are published in the order emitted."""

    def __init__(
        self,
        session_id: str,
        stage: str,
        fence: Fence,
        options: Mapping[str, Any],
        state: dict[str, Any] | None = None,
        session: SettingsPayload | None = None,
        next_response: dict[str, str] | None = None,
        interrupt: Callable[[str], Awaitable[Fence]] | None = None,
        end_turn: Callable[[], Awaitable[Fence]] | None = None,
        emit: Callable[[OutputDraft], None] | None = None,
    ) -> None:
        # Written by hand because ``fence`` is given as a Fence but kept as the stage
        # fence that alone moves it: ``ctx.fence`` reads it and cannot be assigned.
        self.session_id = session_id
        self.stage = stage
        self.stage_fence = StageFence(fence)
        self.options = options
        self.state = {} if state is None else state
        self.session = SettingsPayload() if session is None else session
        self.next_response = next_response
        self.interrupt = interrupt
        self.end_turn = end_turn
        self.emit = emit

    @property
    def fence(self) -> Fence:
        """The fence the stage currently serves (moved on input, cancel and failover)."""
        return self.stage_fence.current


@dataclass(frozen=True, slots=True)
class OutputDraft:
    """An output before the runtime stamps it with fence, stage and seq."""

    kind: OutputKind
    text: str = ""
    data: bytes = b""
    token_ids: tuple[int, ...] = ()
    meta: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    flush: bool = False
    """Publish as it comes instead of batching with the rest of the event's outputs:
    an answer's first at once, later ones coalesced (``workers.coalesce``)."""


StageEvent = InputEvent | OutputEvent
"""What a stage consumes: the session log, or an upstream stage's outputs."""


@dataclass(frozen=True, slots=True)
class RebuildWindow:
    """How much history a backend needs to rebuild a session (None: all of it)."""

    inputs: int | None = None
    """The newest applied inputs."""
    outputs: int | None = None
    """The newest outputs this stage published."""
    resumes_answers: bool = False
    """``start`` rebuilds an answer its predecessor was streaming from the outputs
    already published, and ``handle`` then produces only the rest (a model that
    continues its answer). Otherwise the runtime drops, of the answer produced again,
    as many first drafts as were already published."""


ALL_HISTORY = RebuildWindow()
NO_HISTORY = RebuildWindow(inputs=0, outputs=0)


class StageBackend(Protocol):
    """What the worker runtime needs from a stage backend."""

    name: str
    continuous_input: bool
    """True for backends that process their input as one continuous signal (VAD,
    ASR): inputs accepted before an interruption are handled, not absorbed, since
    the speech that caused the interruption began before it."""
    follows_responses: bool
    """True when outputs belong to the response being produced (a thinker, a TTS):
    a newer response supersedes them. False when they describe the input (VAD, ASR,
    echo): a response reserved meanwhile moves them to the current fence instead."""
    rebuild: RebuildWindow
    """How much of the session's history ``start`` needs after a takeover."""
    edits_conversation: bool
    """True for a model stage that keeps the conversation: conversation edits
    (``EDIT_CONVERSATION`` inputs, or ``conversation`` outputs passed on) reach its
    ``absorb`` (and its ``start`` history); others never see them."""

    async def start(
        self,
        ctx: StageContext,
        inputs: Sequence[StageEvent],
        outputs: Sequence[OutputEvent],
    ) -> None: ...

    def handle(self, ctx: StageContext, event: StageEvent) -> AsyncIterator[OutputDraft]: ...

    async def absorb(self, ctx: StageContext, event: StageEvent) -> None: ...

    async def release(self, ctx: StageContext, fence: Fence) -> None: ...

    async def stop(self, ctx: StageContext) -> None: ...

    async def aclose(self) -> None: ...


class AnswersAtOnce(Protocol):
    """A backend that can answer some events without waiting for anything (optional).

    ``answer_now`` returns the event's whole answer, or None to take the usual path
    (``handle``, run in a task of its own). An answer given at once is staged
    directly and published with the event's progress, never ahead of it: running
    ``handle`` in a task, with a queue for its drafts, cost a cheap stage more than
    the stage itself (``docs/benchmarks.md``)."""

    def answer_now(self, ctx: StageContext, event: StageEvent) -> Sequence[OutputDraft] | None: ...


class LoadsModel(Protocol):
    """A backend with a model to load before it serves (``workers.loading``)."""

    async def load(self) -> StageModel:
        """Load the model (blocking work in a thread) and say what it serves; raise
        when it cannot be loaded (the worker then cannot serve its stage)."""
        ...
