from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from dataplane.bus import RedisBus
from schemas.keys import Keys
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer
from tests.shipped_stack import ShippedStack, StackFailed, serve_shipped_stack

_prefixes = itertools.count()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the test session; tests isolate by key prefix."""
    server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def key_prefix() -> str:
    return f"t{next(_prefixes)}"


@pytest.fixture
async def bus(redis_server: RedisServer, key_prefix: str) -> AsyncIterator[RedisBus]:
    """A bus on the test session's redis-server, under a key prefix of this test's."""
    bus = RedisBus(redis_server.url, Keys(key_prefix))
    yield bus
    await bus.aclose()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One real local Redis Cluster (3 primaries, 3 replicas) for the test session."""
    cluster = RedisCluster(Path(tmp_path_factory.mktemp("cluster")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of the test's own (three primaries, no replicas), whose slots it moves."""
    cluster = RedisCluster(tmp_path, replicas=0)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["redis", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """The URL of a real single Redis, then of a real Redis Cluster: tests taking it run
    on both."""
    if request.param == "cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    return str(request.getfixturevalue("redis_server").url)


@pytest.fixture(scope="session")
def env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty env file for ``docker-compose config``: the compose tests resolve the
    file with the defaults, not with whatever .env the checkout holds."""
    path = tmp_path_factory.mktemp("compose") / "empty.env"
    path.write_text("")
    return path


@pytest.fixture(scope="session")
def shipped_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShippedStack]:
    """The default pipeline served by ``duplexq up`` as shipped (tests/shipped_stack.py),
    shared by every test of what a user meets; it loads once and stops at the end."""
    try:
        with serve_shipped_stack(tmp_path_factory.mktemp("shipped-stack")) as stack:
            yield stack
    except StackFailed as exc:
        pytest.fail(str(exc))
