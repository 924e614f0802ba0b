"""What a ``response.create`` may ask of its one response (``response``), validated.

The reference API's fields that duplexq acts on: ``tools`` / ``tool_choice``
(``schemas.tools``), ``instructions`` (this response's system prompt),
``conversation`` (``"none"``: out of band, the conversation is left as it was),
``input`` (the response's own context instead of the conversation: messages,
function calls and results, references to items by id) and ``metadata``
(echoed on ``response.created`` and ``response.done``). Other fields are
ignored here; ``schemas.session_shape`` owns the session's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.realtime import ITEM_ID, FunctionCallOutputItem, MessageItem
from schemas.tools import FunctionTool, ToolChoice

_MAX_TEXT = 32_768


class FunctionCallItem(BaseModel):
    """A function call the model made, given back as context."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str | None = Field(None, pattern=ITEM_ID)
    type: Literal["function_call"]
    call_id: str = Field(pattern=ITEM_ID)
    name: str = Field(max_length=64)
    arguments: str = Field("", max_length=_MAX_TEXT)


class ItemReference(BaseModel):
    """An item of the conversation, named by id."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["item_reference"]
    id: str = Field(pattern=ITEM_ID)


InputItem = FunctionCallOutputItem | FunctionCallItem | ItemReference | MessageItem


class ResponseParams(BaseModel):
    """``response.create``'s ``response`` object, as far as duplexq acts on it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    tools: tuple[FunctionTool, ...] | None = Field(None, max_length=64)
    tool_choice: ToolChoice | None = None
    instructions: str | None = Field(None, max_length=_MAX_TEXT)
    """This response's system prompt (the session's instructions otherwise)."""
    conversation: Literal["auto", "none"] = "auto"
    """``none``: an out-of-band response; nothing of it joins the conversation."""
    input: tuple[InputItem, ...] | None = Field(None, max_length=64)
    """The response's context instead of the conversation (``[]``: an empty one)."""
    metadata: dict[str, str] | None = Field(None, max_length=16)
    """Up to 16 pairs, echoed on the response's ``response.created`` and ``response.done``."""

    @property
    def out_of_band(self) -> bool:
        return self.conversation == "none"


def chat_message(item: InputItem) -> dict[str, Any]:
    """An input item as the model stage takes it (``workers.backends.vllm_response``)."""
    if isinstance(item, ItemReference):
        return {"ref": item.id}
    if isinstance(item, FunctionCallOutputItem):
        return {"role": "tool", "content": item.output, "tool_call_id": item.call_id}
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": item.role, "content": "".join(part.text for part in item.content)}
