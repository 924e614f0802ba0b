"""A function call through duplexq with the official OpenAI SDK.

    python examples/sdk_function_call.py ws://127.0.0.1:8080 KEY "What time is it?"

Declares one tool (``get_time``) in the session, sends a message, runs the
function when the model calls it, gives the result back and prints the answer
that follows. Any duplexq pipeline with a model stage works; with
``configs/echo.toml`` a message starting with ``call:`` is answered with a call
(the echo backend's test behaviour), and the answer is the result echoed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from openai import AsyncOpenAI

GET_TIME: Any = {
    "type": "function",
    "name": "get_time",
    "description": "The current time, in UTC.",
    "parameters": {"type": "object", "properties": {}},
}


def get_time(arguments: dict[str, Any]) -> str:
    return time.strftime("%H:%M UTC", time.gmtime())


async def call_and_answer(base_url: str, api_key: str, text: str) -> tuple[list[str], str]:
    """The calls the model made (as ``name(arguments)``) and the answer's text."""
    client = AsyncOpenAI(api_key=api_key, websocket_base_url=f"{base_url}/v1")
    calls: list[str] = []
    answer: list[str] = []
    try:
        async with client.realtime.connect(model="duplexq") as connection:
            await connection.session.update(
                session={"type": "realtime", "output_modalities": ["text"], "tools": [GET_TIME]}
            )
            await connection.conversation.item.create(item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]})  # fmt: skip
            await connection.response.create()
            results: list[dict[str, str]] = []
            async for event in connection:
                if event.type == "response.function_call_arguments.done":
                    calls.append(f"{event.name}({event.arguments})")
                    print(f"[calling {calls[-1]}]", flush=True)
                    result = get_time(json.loads(event.arguments or "{}"))
                    results.append({"type": "function_call_output", "call_id": event.call_id,
                                    "output": result})  # fmt: skip
                elif event.type == "response.output_text.delta":
                    answer.append(event.delta)
                    print(event.delta, end="", flush=True)
                elif event.type == "response.done" and answer:
                    print(flush=True)
                    break
                elif event.type == "response.done" and results:
                    # The results go back once the response that made the calls is done:
                    # a response.create while one is in progress is refused.
                    for item in results:
                        await connection.conversation.item.create(item=item)
                    results.clear()
                    await connection.response.create()
    finally:
        await client.close()
    return calls, "".join(answer)


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    asyncio.run(call_and_answer(sys.argv[1], sys.argv[2], sys.argv[3]))


if __name__ == "__main__":
    main()
