"""A browser client of duplexq, and the small backend that lets it in.

    python examples/browser/app.py --duplexq http://127.0.0.1:8080 --key-file var/api_key

then open http://127.0.0.1:8090/. The API key stays here, on the server side:
``POST /token`` mints a short-lived client secret with it (the official SDK's
``client.realtime.client_secrets.create`` against duplexq) and hands the page
only that secret and the WebSocket URL. The page (``index.html``) connects
with the secret as the WebSocket subprotocol the reference API's browser
clients use, sends typed messages and shows the answer as it streams. This is
the shape a web application takes: its own backend holds the key, the browser
never sees it, and a secret it leaks expires in a minute.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import uvicorn
from openai import AsyncOpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

PAGE = Path(__file__).with_name("index.html")
SECRET_LIFETIME_S = 60


def create_app(duplexq_url: str, api_key: str) -> Starlette:
    """The page and its token endpoint, for a duplexq at ``duplexq_url`` (http://...)."""
    websocket_url = "ws" + duplexq_url.removeprefix("http") + "/v1/realtime"

    async def page(request: Request) -> Response:
        return FileResponse(PAGE, headers={"Cache-Control": "no-cache"})

    async def token(request: Request) -> Response:
        client = AsyncOpenAI(api_key=api_key, base_url=f"{duplexq_url}/v1")
        try:
            secret = await client.realtime.client_secrets.create(
                expires_after={"anchor": "created_at", "seconds": SECRET_LIFETIME_S},
                session={"type": "realtime", "output_modalities": ["text"]},
            )
        finally:
            await client.close()
        return JSONResponse({"secret": secret.value, "url": websocket_url})

    return Starlette(routes=[Route("/", page), Route("/token", token, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duplexq", default="http://127.0.0.1:8080", help="duplexq's HTTP URL")
    parser.add_argument("--key-file", type=Path, required=True, help="a file holding the API key")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args()
    key = args.key_file.read_text().strip()
    uvicorn.run(create_app(args.duplexq.rstrip("/"), key), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
