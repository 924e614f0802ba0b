"""The nemesis client against a real echo stack: what it does when a fault strikes
between two events it sends together.

A function-call input is an item and its ``response.create``; the call's response
ends (and the client's result may go) only with the answer that request asked for.
When the socket dies after the server took the item and before it took the request,
the client learns on resuming that the item was taken, and nothing tells it whether
the request was: it must ask again, whether or not the call has come yet. It once
asked again only when the call had come before the resume, and a call that came
after waited for a ``response.done`` that never came: an acknowledged input lost
(the hosts nemesis run, where a partition often strikes between the two). Here the
stage workers start only once the client has resumed, so the call always comes
after it.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from chaos.__main__ import nemesis_pipeline
from chaos.checker import COUNTS, check
from chaos.client import ChaosClient, ClientConfig
from tests.pipeline_helpers import fast_settings, running_worker
from tests.realtime_helpers import serving

pytestmark = pytest.mark.timeout(60)


class DroppedBeforeRequest(ChaosClient):
    """A client whose first item's socket dies once the item is acknowledged, before
    the ``response.create`` sent with it leaves."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.dropped = False

    async def _send_item(self, item: dict[str, Any]) -> None:
        if self.dropped:
            await super()._send_item(item)
            return
        self.dropped = True
        await self._send({"type": "conversation.item.create", "item": item})
        async with asyncio.timeout(10):
            while not self.acked:
                await self._changed.wait()
                self._changed.clear()
        await self.drop(half_open=False)


async def test_a_call_input_whose_request_died_with_the_socket_is_answered(
    redis_server, key_prefix
):
    settings = fast_settings(redis_server.url, key_prefix, api_keys=("k1",))
    pipeline = nemesis_pipeline()
    config = ClientConfig(api_key="k1", cancel_rate=0.0, tool_rate=1.0, wait_s=15.0)
    async with serving(settings, pipeline) as base:
        client = DroppedBeforeRequest(1, random.Random(7), lambda: [base], config, time.monotonic())
        try:
            await client._open()
            answered = asyncio.create_task(client._one_input(1))
            async with asyncio.timeout(10):
                while not any(op.kind == "resume" for op in client.history.ops):
                    await asyncio.sleep(0.02)
            assert client.acked and client._call is None
            async with (
                running_worker(settings, pipeline, "thinker"),
                running_worker(settings, pipeline, "talker"),
            ):
                await asyncio.wait_for(answered, 30)
        finally:
            await client.close()
    result = check([client.history]).clients[0]
    assert {name: result.counts[name] for name in COUNTS} == dict.fromkeys(COUNTS, 0), (
        result.examples
    )
    assert [op.kind for op in client.history.ops].count("block") == 4
