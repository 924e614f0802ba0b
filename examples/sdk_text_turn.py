"""A text turn through duplexq with the official OpenAI SDK.

    python examples/sdk_text_turn.py ws://127.0.0.1:8080 KEY "Hello there"

Connects to ``/v1/realtime`` with ``AsyncOpenAI(...).realtime.connect``, sets the
session in the GA shape, sends one user message, asks for a response and prints
the answer as it streams, then the response's final status. Any duplexq
pipeline works; with ``configs/echo.toml`` the answer is the message echoed.
"""

from __future__ import annotations

import asyncio
import sys

from openai import AsyncOpenAI


async def text_turn(base_url: str, api_key: str, text: str) -> tuple[str, str]:
    """The answer's text and its ``response.done`` status."""
    client = AsyncOpenAI(api_key=api_key, websocket_base_url=f"{base_url}/v1")
    answer: list[str] = []
    try:
        async with client.realtime.connect(model="duplexq") as connection:
            await connection.session.update(
                session={"type": "realtime", "output_modalities": ["text"]}
            )
            await connection.conversation.item.create(
                item={"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": text}]}
            )  # fmt: skip
            await connection.response.create()
            async for event in connection:
                if event.type == "response.output_text.delta":
                    answer.append(event.delta)
                    print(event.delta, end="", flush=True)
                elif event.type == "error":
                    print(f"\n[error {event.error.code}: {event.error.message}]", flush=True)
                elif event.type == "response.done":
                    print(flush=True)
                    return "".join(answer), str(event.response.status)
    finally:
        await client.close()
    return "".join(answer), "connection closed"


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    _, status = asyncio.run(text_turn(sys.argv[1], sys.argv[2], sys.argv[3]))
    print(f"[response {status}]")


if __name__ == "__main__":
    main()
