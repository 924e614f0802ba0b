"""Function tools, as a client declares them and as the model stage takes them.

A client declares tools in ``session.update`` (``session.tools``,
``session.tool_choice``) or for one response (``response.create``'s
``response.tools`` / ``tool_choice``), in the reference API's shape:
``{"type": "function", "name", "description", "parameters": <JSON schema>}``
and ``"auto" | "none" | "required" | {"type": "function", "name"}``.

Stages get them as text (``SettingsPayload.tools`` / ``CommitPayload.tools``):
the tools as a JSON list in the chat-completions shape that chat templates and
vLLM's tool parsers read (``{"type": "function", "function": {...}}``), and the
choice as ``auto``, ``none``, ``required`` or ``function:<name>``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["function"] = "function"
    name: str = Field(pattern=TOOL_NAME)
    description: str = Field("", max_length=4096)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["function"] = "function"
    name: str = Field(pattern=TOOL_NAME)


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


def tools_text(tools: tuple[FunctionTool, ...]) -> str:
    """Tools as the stages take them (empty: none)."""
    if not tools:
        return ""
    listed = [
        {"type": "function", "function": {"name": t.name, "description": t.description,
                                          "parameters": t.parameters}}
        for t in tools
    ]  # fmt: skip
    return json.dumps(listed, separators=(",", ":"), sort_keys=True)


def choice_text(choice: ToolChoice) -> str:
    return f"function:{choice.name}" if isinstance(choice, NamedToolChoice) else choice


def choice_object(text: str) -> ToolChoice:
    """The reference API's form of a stage's choice text."""
    if text.startswith("function:"):
        return NamedToolChoice(name=text.removeprefix("function:"))
    return "none" if text == "none" else "required" if text == "required" else "auto"
