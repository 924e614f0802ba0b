"""The pure core of the ``vllm`` stage: a session's chat history and its rules.

Nothing here does I/O or awaits; ``vllm_backend`` (the shell) calls it and
carries out what it returns. Theory of operation:

- **What an event contributes** (``classify``): text and token inputs (and an
  upstream stage's text deltas and transcripts) are parts of the user's
  message; a turn commit (or an upstream ``done``) closes that message and
  asks for a response; audio, video and everything else contribute nothing
  to a text model.
- **History**: closed user messages and the assistant's responses, in order.
  Consecutive messages of one role are merged when rendered, so a user turn
  that got no answer (absorbed after a barge-in) joins the next one. The
  assistant's part of a response is exactly what was produced for the user:
  a response cut short (barge-in, crash) keeps its produced prefix.
- **Items**: every part of a message is named by the conversation item it
  came from (``schemas.items``: the client's input, the user's utterance, the
  response), so a client's edits (``edit``: an assistant or system message
  added, an item deleted, an answer cut to what the user heard) change
  exactly that item, wherever merging put it.
- **Live responses**: a response being generated is recorded under its
  request id until it ends; whichever comes first, its natural end, its
  release (cancel) or the cancellation of the task generating it, *settles*
  it: the produced text joins the history once, and nothing more is produced
  for it.
- **Rebuild** (failover): replay the recorded inputs, and take each
  response's text from this stage's own accepted outputs (deltas grouped by
  the input ``seq`` that asked for them). Deltas of a commit the previous
  owner had not finished applying are *carried*: when the commit is handled
  again, generation continues after them instead of starting over.
- **Bounds**: the stored history keeps at most ``max_messages`` messages; a
  prompt keeps the system prompt, then drops the oldest messages (whole
  exchanges, so it starts with a user message) until it fits the token
  budget. A newest user message that does not fit alone is refused and
  dropped, so one oversized input cannot wedge the session.
- **Release rule** (``released_by``): a request belongs to a released fence
  when its id decodes to the same session and an (incarnation, epoch) no
  later than the released one. Membership is decided by decoding the id,
  never by comparing prefixes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Literal

from dataplane.request_ids import parse_request_id
from schemas.events import (
    CommitPayload,
    ConversationPayload,
    InputEvent,
    OutputEvent,
    OutputKind,
    TextPayload,
    TokensPayload,
    session_payload_of,
)
from schemas.fence import Fence
from schemas.items import input_item, response_item, speech_item
from workers.backends.base import StageEvent

Part = str | tuple[int, ...]
"""A piece of user input: text, or token ids (decoded when a prompt is rendered)."""
Role = Literal["user", "assistant", "system", "tool"]
Decode = Callable[[Sequence[int]], str]
ChatMessages = list[dict[str, Any]]


class Contribution(Enum):
    NOTHING = auto()
    USER_PART = auto()
    COMMIT = auto()
    EDIT = auto()


def classify(event: StageEvent) -> tuple[Contribution, Part]:
    """What one event adds to a text model's context (for an edit, see ``edit_of``)."""
    edit = session_payload_of(event)
    if isinstance(edit, ConversationPayload):
        return Contribution.EDIT, ""
    if isinstance(event, OutputEvent):
        if event.kind in (OutputKind.TEXT_DELTA, OutputKind.TRANSCRIPT) and event.text:
            return Contribution.USER_PART, event.text
        if event.kind is OutputKind.DONE:
            return Contribution.COMMIT, ""
        return Contribution.NOTHING, ""
    payload = event.payload
    if isinstance(payload, TextPayload) and payload.text:
        return Contribution.USER_PART, payload.text
    if isinstance(payload, TokensPayload) and payload.token_ids:
        return Contribution.USER_PART, payload.token_ids
    if isinstance(payload, CommitPayload):
        return Contribution.COMMIT, ""
    return Contribution.NOTHING, ""


def asks_response(event: StageEvent) -> bool:
    """Whether a commit was a ``response.create``'s (``CommitPayload.respond``, passed
    on as ``meta["respond"]``): it is answered from the conversation whatever it added."""
    if isinstance(event, InputEvent):
        return isinstance(event.payload, CommitPayload) and event.payload.respond
    return event.meta.get("respond") is True


def out_of_band(options: dict[str, Any] | None) -> bool:
    """Whether a ``next_response`` edit's options ask for an out-of-band response."""
    return options is not None and options.get("conversation") == "none"


def edit_of(event: StageEvent) -> ConversationPayload:
    """The conversation edit an ``EDIT`` event carries."""
    edit = session_payload_of(event)
    assert isinstance(edit, ConversationPayload)
    return edit


def call_of(output: OutputEvent) -> dict[str, Any]:
    """A published function call as a chat template's ``tool_calls`` entry."""
    return {"id": str(output.meta.get("call_id", "")), "type": "function",
            "function": {"name": str(output.meta.get("name", "")),
                         "arguments": output.text}}  # fmt: skip


def item_of(event: StageEvent) -> str:
    """The conversation item a user part came from."""
    if isinstance(event, InputEvent):
        named = event.payload.item_id if isinstance(event.payload, TextPayload) else ""
        return named or input_item(event.seq)
    return speech_item(event)


def released_by(request_id: str, fence: Fence) -> bool:
    """Whether releasing ``fence`` releases the request ``request_id`` (decoded)."""
    try:
        parts = parse_request_id(request_id)
    except ValueError:
        return False
    if parts.session_id != fence.session_id:
        return False
    return (parts.incarnation, parts.epoch) <= (fence.incarnation, fence.epoch)


@dataclass(frozen=True, slots=True)
class Produced:
    """Assistant output already delivered for one response."""

    text: str = ""
    token_ids: tuple[int, ...] = ()

    def __add__(self, other: Produced) -> Produced:
        return Produced(self.text + other.text, self.token_ids + other.token_ids)


@dataclass(slots=True)
class Message:
    role: Role
    parts: list[Part]
    items: list[str]
    """The item each part came from (parallel to ``parts``)."""
    calls: list[dict[str, Any]] = field(default_factory=list)
    """An assistant message's function calls (``tool_calls`` entries)."""
    call_id: str = ""
    """A ``tool`` message's call (the result answers it)."""

    def render(self, decode: Decode) -> str:
        return "".join(p if isinstance(p, str) else decode(p) for p in self.parts)

    def chat(self, decode: Decode) -> dict[str, Any]:
        """The message as a chat template takes it."""
        message: dict[str, Any] = {"role": self.role, "content": self.render(decode)}
        if self.calls:
            message["tool_calls"] = list(self.calls)
        if self.call_id:
            message["tool_call_id"] = self.call_id
        return message


@dataclass(slots=True)
class Response:
    """One response while it is generated."""

    request_id: str
    seq: int
    """The input seq (commit) that asked for it."""
    item: str
    """The response's message item (``schemas.items.response_item``)."""
    carried: Produced
    """Delivered before this request started (by a previous owner of the session)."""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    """The function calls it made (``tool_calls`` entries), once it ended."""
    kept: bool = True
    """Its answer joins the history (False: an out-of-band response)."""

    def add(self, text: str, token_ids: Sequence[int]) -> None:
        self.text.append(text)
        self.token_ids.extend(token_ids)

    @property
    def produced(self) -> Produced:
        return self.carried + Produced("".join(self.text), tuple(self.token_ids))


class PromptTooLong(ValueError):
    """The newest user message does not fit the prompt budget on its own."""


@dataclass
class ChatHistory:
    """A session's conversation as the model sees it."""

    max_messages: int
    messages: list[Message] = field(default_factory=list)
    pending: list[tuple[Part, str]] = field(default_factory=list)
    """User parts since the last commit, with their items."""
    turns: int = 0
    """Commits seen; numbers the responses."""
    carried: dict[int, tuple[Produced, str]] = field(default_factory=dict)
    """Deltas already delivered for commits not yet applied, by commit seq (with their
    response's item)."""

    def add_user(self, part: Part, item: str = "") -> None:
        self.pending.append((part, item))

    def close_user(self, seq: int) -> tuple[Produced, str] | None:
        """Close the user's message at commit ``seq``.

        Returns what was already delivered for this commit by a previous owner
        (continue after it) and its response's item, or None when nothing was.
        """
        self.turns += 1
        if self.pending:
            self._append("user", [p for p, _ in self.pending], [i for _, i in self.pending])
            self.pending.clear()
        return self.carried.pop(seq, None)

    def add_assistant(
        self, produced: Produced, item: str = "", calls: Sequence[dict[str, Any]] = ()
    ) -> None:
        """The assistant's part of a response: the text delivered and the calls made."""
        if produced.text or calls:
            self._append("assistant", [produced.text], [item])
            self.messages[-1].calls.extend(calls)

    def edit(self, edit: ConversationPayload) -> None:
        """Apply a client's edit (``ConversationPayload``); an item the history does not
        hold (never seen, or gone with the oldest messages) changes nothing."""
        if edit.op == "add" and edit.role == "tool":
            self.messages.append(Message("tool", [edit.text], [edit.item_id],
                                         call_id=edit.call_id))  # fmt: skip
        elif edit.op == "add" and edit.role in ("assistant", "system") and edit.text:
            self._append("assistant" if edit.role == "assistant" else "system",
                         [edit.text], [edit.item_id])  # fmt: skip
        elif edit.op == "delete":
            self._keep(lambda item, part: None if item == edit.item_id else part)
        elif edit.op == "truncate":
            cut: set[str] = set()

            def truncated(item: str, part: Part) -> Part | None:
                if item != edit.item_id:
                    return part
                first = item not in cut
                cut.add(item)
                return edit.text if first else None

            self._keep(truncated)

    def _keep(self, change: Callable[[str, Part], Part | None]) -> None:
        """Each part replaced by ``change(item, part)`` (None: removed); a message left
        without parts goes, and so does a user part's joiner to a removed part."""
        kept: list[Message] = []
        for message in self.messages:
            parts: list[Part] = []
            items: list[str] = []
            for part, item in zip(message.parts, message.items, strict=True):
                changed = change(item, part)
                if changed is not None and changed != "":
                    parts.append(changed)
                    items.append(item)
            while parts and parts[0] == "\n":
                del parts[0], items[0]
            while parts and parts[-1] == "\n":
                del parts[-1], items[-1]
            if parts or message.calls:
                kept.append(Message(message.role, parts, items, message.calls, message.call_id))
        self.messages = kept

    def awaits_answer(self) -> bool:
        """The last message is the user's, or a function's result the model has not
        seen yet."""
        return bool(self.messages) and self.messages[-1].role in ("user", "tool")

    def drop_last_user(self) -> None:
        if self.awaits_answer():
            self.messages.pop()

    def _append(self, role: Role, parts: list[Part], items: list[str]) -> None:
        if self.messages and self.messages[-1].role == role:
            last = self.messages[-1]
            if role != "assistant":
                last.parts.append("\n")
                last.items.append(items[0])
            last.parts.extend(parts)
            last.items.extend(items)
        else:
            self.messages.append(Message(role, parts, items))
        excess = len(self.messages) - self.max_messages
        if excess > 0:
            del self.messages[:excess]
        while self.messages and self.messages[0].role == "assistant" and len(self.messages) > 1:
            del self.messages[0]

    def chat(self, decode: Decode, system: str | None = None, start: int = 0) -> ChatMessages:
        """Messages from ``start`` on, as a chat template takes them."""
        chat: ChatMessages = [{"role": "system", "content": system}] if system else []
        chat += [m.chat(decode) for m in self.messages[start:]]
        return chat

    def fit(
        self, decode: Decode, count: Callable[[ChatMessages], int], budget: int, system: str | None
    ) -> tuple[ChatMessages, int]:
        """The longest tail of the history whose prompt fits ``budget`` tokens.

        Returns the chat and its token count; drops the oldest exchanges first.
        Raises PromptTooLong when not even the newest user message fits.
        """
        # A conversation with no user message yet (a response.create on a new session, or
        # on system and assistant messages alone) is taken whole.
        starts = [i for i, m in enumerate(self.messages) if m.role == "user"] or [0]
        for start in starts:
            chat = self.chat(decode, system, start)
            tokens = count(chat)
            if tokens <= budget:
                return chat, tokens
        raise PromptTooLong(f"the newest user message does not fit {budget} prompt tokens")


def rebuild(
    history: ChatHistory, inputs: Sequence[StageEvent], outputs: Sequence[OutputEvent]
) -> dict[str, Any] | None:
    """Replay recorded inputs and this stage's accepted outputs into ``history``; the
    options of a ``next_response`` edit no commit took yet are returned (the new owner's
    next response takes them), and an out-of-band response's answer is left out."""
    answers: dict[int, tuple[Produced, str]] = {}
    calls: dict[int, list[dict[str, Any]]] = {}
    for output in outputs:
        if output.kind is OutputKind.FUNCTION_CALL:
            calls.setdefault(output.source_seq, []).append(call_of(output))
        elif output.kind is OutputKind.TEXT_DELTA:
            delta = Produced(output.text, output.token_ids)
            so_far = answers.get(output.source_seq, (Produced(), ""))[0]
            answers[output.source_seq] = (so_far + delta, response_item(output.fence))
    last_seq = 0
    options: dict[str, Any] | None = None
    for event in inputs:
        last_seq = max(last_seq, event.seq)
        contribution, part = classify(event)
        if contribution is Contribution.USER_PART:
            history.add_user(part, item_of(event))
        elif contribution is Contribution.COMMIT:
            history.close_user(event.seq)
            if not out_of_band(options):
                history.add_assistant(*answers.get(event.seq, (Produced(), "")),
                                      calls.get(event.seq, ()))  # fmt: skip
            options = None
        elif contribution is Contribution.EDIT:
            edit = edit_of(event)
            if edit.op == "next_response":
                options = json.loads(edit.text or "{}")
            history.edit(edit)
    history.carried = {seq: done for seq, done in answers.items() if seq > last_seq}
    return options
