"""Credentials as browsers and servers present them: Bearer header, WebSocket
subprotocol, short-lived client secrets (minted with the official SDK), and clean
refusals of anything wrong. Real uvicorn, real Redis, echo workers."""

import contextlib
import json
import time

import httpx
import openai
import pytest
import websockets
from openai import AsyncOpenAI

from schemas.config import echo_pipeline
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import (
    Client,
    coordinator_process,
    serving,
    text_turn,
    until_completed,
)


@pytest.fixture
def settings(redis_server, key_prefix):
    return fast_settings(redis_server.url, key_prefix, api_keys=("k1",), first_event_wait_ms=50)


def _http(base: str) -> str:
    return base.replace("ws://", "http://", 1)


async def _connect_subprotocol(base: str, credential: str, offered=("realtime",)):
    protocols = [*offered, f"openai-insecure-api-key.{credential}"]
    return websockets.connect(f"{base}/v1/realtime", subprotocols=protocols)


async def test_the_subprotocol_form_is_accepted_and_realtime_is_echoed(settings):
    async with serving(settings, echo_pipeline("echo")) as base:
        async with await _connect_subprotocol(base, "k1") as ws:
            assert ws.subprotocol == "realtime"  # the credential is never echoed
            assert json.loads(await ws.recv())["type"] == "session.created"
        for wrong in ("k2", "", "k1.k1", "ek_"):
            with pytest.raises(websockets.exceptions.InvalidStatus) as info:
                async with await _connect_subprotocol(base, wrong):
                    pass
            assert info.value.response.status_code == 403
        # Malformed subprotocol headers are refused (400 where the header does not parse,
        # 403 where it parses but holds no valid credential), never a crash.
        for header in (
            ",,,",
            " , realtime ,",
            "realtime, openai-insecure-api-key.cl\u00e9",
            "openai-insecure-api-key.\u00ff\u00fe, realtime",
            "realtime;x=1",
        ):
            with pytest.raises(websockets.exceptions.InvalidStatus) as info:
                headers = {"Sec-WebSocket-Protocol": header}
                async with websockets.connect(f"{base}/v1/realtime", additional_headers=headers):
                    pass
            assert info.value.response.status_code in (400, 403)
        # The server still serves after all of that.
        async with Client.connect(base) as client:
            assert (await client.recv())["type"] == "session.created"


async def test_a_client_secret_minted_with_the_sdk_opens_sessions_on_any_coordinator(
    settings, redis_client
):
    pipeline = echo_pipeline("echo")
    async with (
        contextlib.AsyncExitStack() as stack,
        serving(settings, pipeline) as base,
        serving(settings, pipeline) as other,
        running_worker(settings, pipeline, "echo"),
    ):
        sdk = AsyncOpenAI(api_key="k1", base_url=f"{_http(base)}/v1")
        stack.push_async_callback(sdk.close)
        before = int(time.time())
        minted = await sdk.realtime.client_secrets.create(
            expires_after={"anchor": "created_at", "seconds": 60},
            session={"type": "realtime", "instructions": "be brief"},
        )
        assert minted.value.startswith("ek_") and len(minted.value) > 40
        assert before + 59 <= minted.expires_at <= int(time.time()) + 61
        assert minted.session.type == "realtime"
        assert minted.session.instructions == "be brief"
        # Redis holds the secret's digest, never the secret, with its lifetime as TTL.
        stored = [k async for k in redis_client.scan_iter(match=f"{settings.key_prefix}:secret:*")]
        assert len(stored) == 1 and minted.value.encode() not in stored[0]
        assert 0 < await redis_client.ttl(stored[0]) <= 60

        # The browser form, on the other coordinator: the secret as a subprotocol; the
        # session starts with the secret's settings.
        async with await _connect_subprotocol(other, minted.value) as ws:
            assert ws.subprotocol == "realtime"
            assert json.loads(await ws.recv())["type"] == "session.created"
            updated = json.loads(await ws.recv())
            assert updated["type"] == "session.updated"
            assert updated["session"]["instructions"] == "be brief"

        # The SDK form: the secret as its api_key (a Bearer header); a text turn works.
        client = AsyncOpenAI(api_key=minted.value, websocket_base_url=f"{base}/v1")
        stack.push_async_callback(client.close)
        async with client.realtime.connect(model="duplexq") as connection:
            await connection.conversation.item.create(
                item={"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "by secret"}]}
            )  # fmt: skip
            await connection.response.create()
            text = ""
            async for event in connection:
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type == "response.done":
                    break
        assert text == "by secret"

        # The default lifetime applies without a body, and an unknown secret is refused.
        plain = await sdk.realtime.client_secrets.create()
        assert abs(plain.expires_at - time.time() - settings.client_secret_ttl_s) < 5
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            async with await _connect_subprotocol(base, "ek_" + "A" * 43):
                pass
        assert info.value.response.status_code == 403


async def test_sessions_of_a_client_secret_count_against_the_minting_key(settings):
    settings = settings.model_copy(update={"api_keys": ("k1", "k2"), "max_sessions_per_key": 1})
    async with (
        serving(settings, echo_pipeline("echo")) as base,
        AsyncOpenAI(api_key="k1", base_url=f"{_http(base)}/v1") as sdk,
    ):
        secret = (await sdk.realtime.client_secrets.create()).value
        async with await _connect_subprotocol(base, secret) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            async with Client.connect(base, key="k1") as same_key:
                refused = await same_key.recv()
                assert refused["error"]["code"] == "session_limit"
            async with Client.connect(base, key="k2") as other_key:
                assert (await other_key.recv())["type"] == "session.created"


async def test_minting_refuses_wrong_keys_and_bad_bodies_with_stable_codes(settings):
    async with serving(settings, echo_pipeline("echo")) as base:
        url = f"{_http(base)}/v1/realtime/client_secrets"
        async with httpx.AsyncClient() as http:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": b"Bearer cl\xc3\xa9"},
                {"Authorization": b"Bearer \xff\xfe"},
                {"Authorization": "Basic azE6"},
            ):
                answer = await http.post(url, headers=headers)
                assert answer.status_code == 401
                assert answer.json()["error"]["code"] == "unauthorized"
            good = {"Authorization": "Bearer k1"}
            minted = (await http.post(url, headers=good)).json()["value"]
            # A client secret cannot mint another.
            answer = await http.post(url, headers={"Authorization": f"Bearer {minted}"})
            assert answer.status_code == 401
            for body in (
                b"{not json",
                json.dumps({"expires_after": {"seconds": 5}}).encode(),
                json.dumps({"expires_after": {"anchor": "now", "seconds": 60}}).encode(),
                json.dumps({"session": {"audio": "loud"}}).encode(),
                json.dumps({"extra": 1}).encode(),
            ):
                answer = await http.post(url, headers=good, content=body)
                assert answer.status_code == 400, body
                assert answer.json()["error"]["code"] == "invalid_input"
            # The official SDK surfaces a wrong key as its authentication error.
            wrong = AsyncOpenAI(api_key="wrong", base_url=f"{_http(base)}/v1", max_retries=0)
            async with wrong:
                with pytest.raises(openai.AuthenticationError):
                    await wrong.realtime.client_secrets.create()


async def test_anonymous_minting_where_anonymous_clients_are_allowed(redis_server, key_prefix):
    settings = fast_settings(redis_server.url, key_prefix, allow_anonymous=True)
    async with serving(settings, echo_pipeline("echo")) as base, httpx.AsyncClient() as http:
        answer = await http.post(f"{_http(base)}/v1/realtime/client_secrets")
        assert answer.status_code == 200
        async with await _connect_subprotocol(base, answer.json()["value"]) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"


async def test_no_credential_reaches_the_access_log(settings, tmp_path):
    """The coordinator at info level (as compose runs it) logs every request; neither
    the API key nor a client secret appears in what it writes."""
    key = "dq-key-4f9a0c"
    settings = settings.model_copy(update={"api_keys": (key,)})
    pipeline = echo_pipeline("echo")
    log_path = tmp_path / "coordinator.log"
    info = ("--log-level", "info")
    async with coordinator_process(settings, pipeline, tmp_path, *info, log=log_path) as base:
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{_http(base)}/v1/realtime/client_secrets",
                headers={"Authorization": f"Bearer {key}"},
            )
            secret = answer.json()["value"]
        async with Client.connect(base, key=key) as client:
            await client.recv()
        async with await _connect_subprotocol(base, secret) as ws:
            await ws.recv()
        with pytest.raises(websockets.exceptions.InvalidStatus):
            async with await _connect_subprotocol(base, key + "-wrong-guess"):
                pass
    written = log_path.read_text()
    assert "client_secrets" in written and "/v1/realtime" in written  # it did log requests
    for credential in (key, secret[3:]):
        assert credential not in written, credential


async def test_a_text_turn_with_the_bearer_header_still_works(settings):
    pipeline = echo_pipeline("echo")
    async with (
        serving(settings, pipeline) as base,
        running_worker(settings, pipeline, "echo"),
        Client.connect(base) as client,
    ):
        await client.recv()
        for event in text_turn("bearer"):
            await client.send(event)
        events = await until_completed(client)
    assert events[-1]["response"]["status"] == "completed"
