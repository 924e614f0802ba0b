"""The pure core of the ``minicpmo`` stage: a session's duplex prompt and its rules.

Nothing here does I/O or awaits; ``minicpmo_stage`` (the shell) calls it and
carries out what it returns. Theory of operation:

- **What an event is** (``classify``): a *unit* (``append_unit``,
  ``append_audio_chunk``, ``append_video_frame``) joins the prompt and asks
  the model to decide; *context* (``append_text``, ``append_tokens``) joins
  the prompt without a decision; a *commit* (``turn_commit_only``) ends the
  user's turn; everything else (audio clears, playback acks, upstream
  outputs) contributes nothing.
- **The prompt** (``DuplexPrompt``): the token ids the model sees, built
  only from the extension's append plans and the model's own tokens. The
  first context reserve planned becomes the *prefix*: it is room for the
  system prefix, so it stays at the front (before token appends that were
  planned earlier without a reserve) and is kept for the whole session.
  Every other append (a unit's placeholders, a text's tokens) is a
  *segment*, and what the model produced for a unit extends that unit's
  segment. ``fit`` drops the oldest segments, whole, until the prompt fits
  the budget, so a unit leaves with its answer; a newest segment that
  cannot fit even alone is refused (``PromptTooLong``). Each segment keeps
  the decoded media behind its placeholders (``minicpmo_media.UnitMedia``),
  dropped with it.
- **One unit's answer** (``UnitTurn``): the extension's decision for each
  streamed step is turned into drafts. The first step with content opens
  speech (a ``speak`` marker), text follows as ``text_delta``; a ``listen``
  decision ends the turn with a ``listen`` marker (after any text spoken
  in the same step). Token ids ride on the drafts: a ``text_delta`` carries
  its step's ids (and those of earlier steps that had no text), ``listen``
  carries the listen token id. So the drafts hold every token the model
  produced for the unit, in order, and ``produced`` (what joins the prompt)
  is exactly what was published: a failover rebuild from the published
  outputs gives the same prompt.
- **Rebuild** (``rebuild``): replay the recorded inputs through the plans
  (skipping an input whose plan fails, as it failed when live), and after
  each input add the tokens of this stage's outputs for it (grouped by the
  input ``seq`` they answered). Outputs for an input the previous owner had
  not finished applying (it is delivered again) are *carried*: when that
  input is handled, a unit's answer is taken from them instead of deciding
  again, and a commit's ``done`` is not repeated, so the client does not
  get one input answered twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto

from schemas.events import InputEvent, InputMode, OutputEvent, OutputKind
from workers.backends.base import StageEvent
from workers.backends.minicpmo_media import NO_MEDIA, UnitMedia
from workers.extensions.base import AppendPlan, Decision, DecisionAction

UNIT_MODES = frozenset(
    {InputMode.APPEND_UNIT, InputMode.APPEND_AUDIO_CHUNK, InputMode.APPEND_VIDEO_FRAME}
)
CONTEXT_MODES = frozenset({InputMode.APPEND_TEXT, InputMode.APPEND_TOKENS})
TOKEN_KINDS = frozenset({OutputKind.TEXT_DELTA, OutputKind.SPEAK, OutputKind.LISTEN})
"""Output kinds whose token ids are the model's own tokens (they rejoin the prompt)."""


class Contribution(Enum):
    NOTHING = auto()
    UNIT = auto()
    CONTEXT = auto()
    COMMIT = auto()


def classify(event: StageEvent) -> Contribution:
    """What one event does to a duplex session."""
    if not isinstance(event, InputEvent):
        return Contribution.NOTHING
    if event.mode in UNIT_MODES:
        return Contribution.UNIT
    if event.mode in CONTEXT_MODES:
        return Contribution.CONTEXT
    if event.mode is InputMode.TURN_COMMIT_ONLY:
        return Contribution.COMMIT
    return Contribution.NOTHING


class PromptTooLong(ValueError):
    """The newest segment does not fit the prompt budget, even with the others dropped."""


@dataclass
class DuplexPrompt:
    """A session's stage-0 prompt (see the module docstring)."""

    prefix: tuple[int, ...] = ()
    segments: deque[tuple[int, ...]] = field(default_factory=deque)
    media: deque[UnitMedia] = field(default_factory=deque)
    """The media behind each segment's placeholders, one entry per segment."""
    length: int = 0
    """Tokens in ``segments`` (the prefix not counted)."""
    dropped: int = 0
    """Segments dropped by ``fit`` so far."""

    @property
    def first_append(self) -> bool:
        """Whether the next plan should carry the context reserve (no prefix yet)."""
        return not self.prefix

    def add_plan(self, plan: AppendPlan, media: UnitMedia = NO_MEDIA) -> None:
        reserve = plan.buffer.context_reserve
        if reserve:
            self.prefix = plan.prompt_token_ids[:reserve]
        self.add(plan.prompt_token_ids[reserve:], media)

    def add(self, token_ids: Sequence[int], media: UnitMedia = NO_MEDIA) -> None:
        """Append one segment (no-op when empty)."""
        if token_ids:
            self.segments.append(tuple(token_ids))
            self.media.append(media)
            self.length += len(token_ids)

    def answer(self, token_ids: Sequence[int]) -> None:
        """Append the model's tokens to the latest segment: a unit and what the
        model said after it are dropped together."""
        if not token_ids:
            return
        if not self.segments:
            self.add(token_ids)
            return
        self.segments[-1] += tuple(token_ids)
        self.length += len(token_ids)

    def tokens(self) -> list[int]:
        ids = list(self.prefix)
        for segment in self.segments:
            ids.extend(segment)
        return ids

    def __len__(self) -> int:
        return len(self.prefix) + self.length

    def fit(self, budget: int) -> int:
        """Drop the oldest segments until the prompt holds at most ``budget`` tokens.

        Returns how many were dropped; raises PromptTooLong (dropping the
        newest segment, so one oversized input cannot wedge the session)
        when the prefix and the newest segment alone exceed the budget.
        """
        newest = len(self.segments[-1]) if self.segments else 0
        if len(self.prefix) + newest > budget:
            if self.segments:
                self.length -= len(self.segments.pop())
                self.media.pop()
            raise PromptTooLong(
                f"a segment of {newest} tokens after a {len(self.prefix)}-token prefix "
                f"does not fit {budget} prompt tokens"
            )
        count = 0
        while len(self) > budget:
            self.length -= len(self.segments.popleft())
            self.media.popleft()
            count += 1
        self.dropped += count
        return count


@dataclass(frozen=True, slots=True)
class Emission:
    """One draft a decision asks for: its kind, text and the model's token ids."""

    kind: OutputKind
    text: str = ""
    token_ids: tuple[int, ...] = ()


@dataclass
class UnitTurn:
    """The model's answer to one unit while it streams (see the module docstring)."""

    request_id: str
    seq: int
    """The input seq of the unit."""
    speaking: bool = False
    ended: bool = False
    """A listen decision ended the turn: nothing more is read."""
    pending: list[int] = field(default_factory=list)
    """Ids of text-less speech steps, carried to the next draft."""
    produced: list[int] = field(default_factory=list)
    """Every token id published for this unit, in order."""

    @property
    def decision(self) -> str:
        """``listen``, ``speak`` or ``none`` (nothing decided yet)."""
        if self.ended:
            return "listen"
        return "speak" if self.speaking else "none"

    def read(self, decision: Decision) -> list[Emission]:
        """The drafts one streamed step's decision asks for."""
        if self.ended or decision.action is DecisionAction.CONTINUE:
            return []
        out: list[Emission] = []
        if decision.text or decision.token_ids:
            if not self.speaking:
                self.speaking = True
                out.append(Emission(OutputKind.SPEAK))
            if decision.text:
                out.append(Emission(OutputKind.TEXT_DELTA, decision.text, self._take(decision)))
            else:
                self.pending.extend(decision.token_ids)
        if decision.action is DecisionAction.LISTEN:
            self.ended = True
            listen_id = decision.metadata.get("listen_token_id")
            ids = self._take() + ((listen_id,) if isinstance(listen_id, int) else ())
            out.append(Emission(OutputKind.LISTEN, "", ids))
        for emission in out:
            self.produced.extend(emission.token_ids)
        return out

    def finish(self) -> list[Emission]:
        """Drafts still owed when the stream ends: text-less tokens not yet published."""
        if not self.pending:
            return []
        emission = Emission(OutputKind.TEXT_DELTA, "", self._take())
        self.produced.extend(emission.token_ids)
        return [emission]

    def _take(self, decision: Decision | None = None) -> tuple[int, ...]:
        ids = tuple(self.pending) + (decision.token_ids if decision is not None else ())
        self.pending.clear()
        return ids


Plan = Callable[[InputEvent, bool], AppendPlan | None]
"""Plans one recorded input (``first_append`` as the second argument); None skips it."""
Media = Callable[[InputEvent, AppendPlan], UnitMedia]
"""The decoded media of one recorded input, given its plan."""


def rebuild(
    prompt: DuplexPrompt,
    inputs: Sequence[StageEvent],
    outputs: Sequence[OutputEvent],
    plan: Plan,
    media: Media = lambda event, plan: NO_MEDIA,
) -> dict[int, tuple[int, ...]]:
    """Replay recorded inputs and this stage's accepted outputs into ``prompt``.

    Returns the carried answers: by the seq of an input not replayed, the
    token ids published for it (empty for a ``done``); see the module docstring.
    """
    answers: dict[int, list[int]] = {}
    for output in sorted(outputs, key=lambda o: (o.fence.incarnation, o.seq)):
        ids = answers.setdefault(output.source_seq, [])
        if output.kind in TOKEN_KINDS:
            ids.extend(output.token_ids)
    last_seq = 0
    for event in inputs:
        last_seq = max(last_seq, event.seq)
        if classify(event) in (Contribution.UNIT, Contribution.CONTEXT):
            assert isinstance(event, InputEvent)
            planned = plan(event, prompt.first_append)
            if planned is not None:
                prompt.add_plan(planned, media(event, planned))
        prompt.answer(answers.pop(event.seq, ()))
    return {seq: tuple(ids) for seq, ids in answers.items() if seq > last_seq}
