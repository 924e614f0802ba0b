"""What one ``response.create`` asks of the ``vllm`` stage's next response (pure).

The coordinator passes a response's own options down the chain as a
``next_response`` edit (``coordinator.response_requests``); the runtime keeps
them in ``StageContext.next_response`` until the response that takes them:

- ``tools`` / ``tool_choice``: ``vllm_tools.plan_for``;
- ``instructions``: the system prompt of this response only;
- ``conversation: "none"``: an out-of-band response, whose answer never joins
  the history (the conversation stays as it was);
- ``input``: the response's context instead of the conversation, a JSON list
  of chat messages (``role``, ``content``, a tool result's ``tool_call_id``, an
  assistant's ``tool_calls``) or references to items the history holds
  (``{"ref": <item id>}``); ``[]`` is an empty context.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.backends.vllm_history import ChatHistory, ChatMessages, Decode

_ROLES = ("user", "assistant", "system", "tool")


@dataclass(frozen=True, slots=True)
class ResponseSpec:
    """One response's own options (the defaults: the session's, in the conversation)."""

    instructions: str = ""
    out_of_band: bool = False
    context: tuple[dict[str, Any], ...] | None = None
    """The response's own input (None: the conversation)."""


def spec_of(options: Mapping[str, str] | None) -> ResponseSpec:
    """The spec a ``next_response`` edit's options give (unknown or bad fields: none)."""
    if not options:
        return ResponseSpec()
    context: tuple[dict[str, Any], ...] | None = None
    raw = options.get("input")
    if raw is not None:
        try:
            listed = json.loads(raw)
        except ValueError:
            listed = []
        listed = listed if isinstance(listed, list) else []
        context = tuple(m for m in listed if isinstance(m, dict))
    return ResponseSpec(
        instructions=str(options.get("instructions") or ""),
        out_of_band=options.get("conversation") == "none",
        context=context,
    )


def context_chat(
    spec: ResponseSpec, history: ChatHistory, decode: Decode, system: str
) -> ChatMessages:
    """The chat of a response with its own input: the system prompt, then each message,
    a reference replaced by what the history holds of that item (nothing if it holds
    none of it)."""
    chat: ChatMessages = [{"role": "system", "content": system}] if system else []
    for message in spec.context or ():
        ref = message.get("ref")
        if isinstance(ref, str):
            chat += _referenced(history, ref, decode)
        elif message.get("role") in _ROLES:
            chat.append({k: v for k, v in message.items()
                         if k in ("role", "content", "tool_call_id", "tool_calls")})  # fmt: skip
    return chat


def _referenced(history: ChatHistory, item: str, decode: Decode) -> ChatMessages:
    found: ChatMessages = []
    for message in history.messages:
        parts = [p for p, i in zip(message.parts, message.items, strict=True) if i == item]
        if not parts:
            continue
        text = "".join(p if isinstance(p, str) else decode(p) for p in parts)
        entry: dict[str, Any] = {"role": message.role, "content": text}
        if message.calls:
            entry["tool_calls"] = list(message.calls)
        if message.call_id:
            entry["tool_call_id"] = message.call_id
        found.append(entry)
    return found
