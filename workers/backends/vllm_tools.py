"""Function calling in the ``vllm`` stage: tools into the prompt, calls out of the answer.

Which tools a response may use (``ToolPlan``): the session's (``SettingsPayload``),
or those a ``response.create`` named for that one response (a ``next_response``
edit, taken by the next response only).

Into the prompt: when the model's chat template renders tools (it mentions
``tools``), the tools go to the template (``apply_chat_template(tools=...)``),
as the model was trained to see them. A template without tool support gets them
as a system message in the Hermes format instead (``describe``), and the
history's calls and results written out in that format (``plain_history``).

Out of the answer:

- ``auto`` (and ``required`` where the model follows it): text streams as it
  comes, except what may be the start of a call tag (``CallGate``); once a tag
  starts, the rest is held and, when the answer ends, vLLM's own tool parser for
  the model family (option ``tool_parser``, default ``hermes``: Qwen2.5,
  Hermes, the tiny test model's template) turns it into calls.
- a named function (``{"type": "function", "name": ...}``) or ``required``:
  generation is constrained to JSON (vLLM structured outputs): the function's
  arguments, or one ``{"name", "arguments"}`` object of the tools; nothing of
  it streams as text.

A call's id is derived from its response's fence and its place in the answer
(``call_<epoch>_<turn>_<response>_<n>``): the same call keeps its id however
often it is rebuilt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.events import SettingsPayload
from schemas.fence import Fence

CALL_TAG = "<tool_call>"
CALL_END = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The tools one response may call and how it must choose."""

    tools: tuple[dict[str, Any], ...] = ()
    """Chat-completions shaped: ``{"type": "function", "function": {...}}``."""
    choice: str = "auto"

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> str | None:
        """``required``, or the name of the function the answer must call."""
        if not self.active or self.choice == "auto":
            return None
        return self.choice.removeprefix("function:")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced answer is generated under (None: free text)."""
        forced = self.forced
        if forced is None:
            return None
        if forced != "required":
            return dict(self._function(forced).get("parameters") or {"type": "object"})
        return {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": tool["function"]["name"]},
                            "arguments": tool["function"].get("parameters") or {}}}
            for tool in self.tools
        ]}  # fmt: skip

    def _function(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return dict(tool["function"])
        return {"name": name, "parameters": {"type": "object"}}


def plan_for(session: SettingsPayload, override: dict[str, str] | None) -> ToolPlan:
    """The plan of the next response: the session's tools and choice, each replaced by
    what a ``response.create`` named for it."""
    override = override or {}
    text = override.get("tools", session.tools)
    choice = override.get("tool_choice", session.tool_choice) or "auto"
    try:
        tools = tuple(json.loads(text)) if text else ()
    except ValueError:
        tools = ()
    return ToolPlan(tools, choice)


def call_id(fence: Fence, index: int) -> str:
    return f"call_{fence.epoch}_{fence.turn_id}_{fence.response_seq}_{index}"


@dataclass(slots=True)
class Call:
    """One function call of an answer."""

    call_id: str
    name: str
    arguments: str

    def chat(self) -> dict[str, Any]:
        """The call as a chat template's ``tool_calls`` entry."""
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def forced_calls(plan: ToolPlan, text: str, fence: Fence) -> list[Call]:
    """The call a constrained answer makes (none when it does not parse)."""
    forced = plan.forced
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if forced == "required":
        if not isinstance(value, dict) or "name" not in value:
            return []
        name, arguments = str(value["name"]), value.get("arguments", {})
    else:
        name, arguments = str(forced), value
    return [Call(call_id(fence, 0), name, json.dumps(arguments, separators=(",", ":")))]


@dataclass(slots=True)
class CallGate:
    """Streams an answer's text while no call tag has started (holding back what may be
    the start of one), and holds everything from the tag on."""

    held: list[tuple[Any, str]] = field(default_factory=list)
    """Steps held back, with their text (a possible tag start, or all once calling)."""
    calling: bool = False
    text: str = ""
    """All the answer's text so far."""

    def feed(self, step: Any, text: str) -> list[Any]:
        """The steps that may stream now, after ``step`` (carrying ``text``) came."""
        self.text += text
        self.held.append((step, text))
        if self.calling:
            return []
        pending = "".join(piece for _, piece in self.held)
        if CALL_TAG in pending:
            self.calling = True
            return []
        if _may_start_tag(pending):
            return []
        return self.flush()

    def flush(self) -> list[Any]:
        """The steps held back, unless a call started (they are the call's)."""
        if self.calling:
            return []
        ready, self.held = [step for step, _ in self.held], []
        return ready


def _may_start_tag(text: str) -> bool:
    """Whether ``text`` ends with a proper prefix of the call tag."""
    return any(text.endswith(CALL_TAG[:n]) for n in range(1, len(CALL_TAG)))


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def describe(tools: Sequence[dict[str, Any]]) -> str:
    """The tools as a system message, for a chat template that has no place for them."""
    listed = "\n".join(json.dumps(tool["function"], sort_keys=True) for tool in tools)
    return (
        "You can call functions. The functions, one JSON description per line:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, answer with "
        f'{CALL_TAG}{{"name": <function name>, "arguments": <JSON object>}}{CALL_END} '
        "and nothing after it; a function's result comes back as "
        "<tool_response>...</tool_response>."
    )


def with_system_note(chat: Sequence[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """``chat`` with ``note`` added to its system message (one is made when none)."""
    if chat and chat[0]["role"] == "system":
        first = {**chat[0], "content": f"{chat[0]['content']}\n\n{note}"}
        return [first, *chat[1:]]
    return [{"role": "system", "content": note}, *chat]


def plain_history(chat: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat with calls and results written as text, for a template without tools."""
    plain: list[dict[str, Any]] = []
    for message in chat:
        if message["role"] == "tool":
            content = f"<tool_response>{message['content']}</tool_response>"
            plain.append({"role": "user", "content": content})
        elif message.get("tool_calls"):
            calls = "".join(
                f'{CALL_TAG}{{"name": {json.dumps(c["function"]["name"])}, '
                f'"arguments": {c["function"]["arguments"]}}}{CALL_END}'
                for c in message["tool_calls"]
            )
            plain.append({"role": "assistant", "content": message["content"] + calls})
        else:
            plain.append(message)
    return plain
