"""The far end of the raw round trip: a bare Redis Streams echo in its own process.

``python -m bench.raw_peer URL INBOX OUTBOX COUNT`` reads ``INBOX`` through a
consumer group (blocking XREADGROUP, up to ``COUNT`` entries), acknowledges
what it read (XACK) and appends each entry back to ``OUTBOX`` (XADD) with the
time it received it. With ``COUNT`` 1 every message costs its own commands;
with more, one XACK and one pipelined round of XADDs serve the whole batch.

It is the least a stage worker could do per event (read, acknowledge,
answer) with the same client library duplexq uses, and no fences, leases,
ordering or encoding: the floor the pipeline is compared to. A message with
a ``stop`` field ends it.
"""

from __future__ import annotations

import asyncio
import sys
import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

GROUP = "peer"


async def ensure_group(client: aioredis.Redis, stream: str) -> None:
    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def serve(url: str, inbox: str, outbox: str, count: int) -> None:
    client = aioredis.Redis.from_url(url, socket_timeout=30)
    await ensure_group(client, inbox)
    await ensure_group(client, outbox)
    await client.set(f"{inbox}:ready", "1")
    try:
        while True:
            reply = await client.xreadgroup(GROUP, "p", {inbox: ">"}, count=count, block=1000)
            if not reply:
                continue
            received = time.monotonic_ns()
            messages = reply[0][1]
            if count == 1:
                for entry_id, fields in messages:
                    await client.xack(inbox, GROUP, entry_id)
                    await client.xadd(outbox, {**fields, b"t1": received})
            else:
                pipe = client.pipeline(transaction=False)
                pipe.xack(inbox, GROUP, *(entry_id for entry_id, _ in messages))
                for _, fields in messages:
                    pipe.xadd(outbox, {**fields, b"t1": received})
                await pipe.execute()
            if any(b"stop" in fields for _, fields in messages):
                return
    finally:
        await client.aclose()


def main(argv: list[str]) -> int:
    url, inbox, outbox, count = argv
    asyncio.run(serve(url, inbox, outbox, int(count)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
