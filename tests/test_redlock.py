"""Redlock over five real redis-server processes: quorum, nodes killed, paused and
restarted empty."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, LockError, LockNotOwnedError

from dedup.errors import ConfigError, QuorumUnavailable
from dedup.lock import Redlock
from tests.servers import RedisServer

DEADLINE_S = 30.0
KEY = b"res"


@pytest.fixture
def nodes() -> Iterator[list[RedisServer]]:
    servers: list[RedisServer] = []
    try:
        for _ in range(5):
            servers.append(RedisServer().start())
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
async def clients(nodes: list[RedisServer]) -> AsyncIterator[list[Redis]]:
    # Reconnect once after a restart; a dead node fails fast anyway (and Redlock
    # bounds every node's answer by its node timeout).
    made = [
        Redis.from_url(
            s.url,
            socket_timeout=2,
            socket_connect_timeout=2,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[ConnectionError],
        )
        for s in nodes
    ]
    try:
        yield made
    finally:
        for client in made:
            await client.aclose()


def redlock(
    clients: list[Redis], *, timeout: float = 10, sleep: float = 0.2, node_timeout_s: float = 0.5
) -> Redlock:
    # Fresh test servers are younger than any TTL: the restart rule is tested on its own.
    return Redlock(
        clients,
        "res",
        timeout=timeout,
        sleep=sleep,
        node_timeout_s=node_timeout_s,
        restart_guard=False,
    )


async def held_by(clients: list[Redis]) -> list[bytes | str | None]:
    return [await c.get(KEY) for c in clients]


async def test_quorum_lock(clients: list[Redis]) -> None:
    lock = redlock(clients)
    assert lock.quorum == 3
    assert await lock.acquire(blocking=False)
    assert await held_by(clients) == [lock.token] * 5
    assert 0 < lock.validity_s <= 10 - (0.01 * 10 + 0.002)
    assert await lock.owned() and await lock.locked()
    other = redlock(clients)
    assert not await other.acquire(blocking=False)
    assert not await other.owned()
    assert await held_by(clients) == [lock.token] * 5  # the loser left nothing behind
    assert await lock.extend(5)
    assert all(0 < ttl <= 5000 for ttl in [await c.pttl(KEY) for c in clients])
    await lock.release()
    assert await held_by(clients) == [None] * 5
    assert not await lock.locked()
    with pytest.raises(LockError):
        await lock.release()


async def test_context_manager_and_blocking_wait(clients: list[Redis]) -> None:
    async with redlock(clients) as lock:
        assert await lock.owned()
    assert await held_by(clients) == [None] * 5
    first = redlock(clients, timeout=0.5)
    assert await first.acquire(blocking=False)
    second = redlock(clients, sleep=0.05)
    assert await second.acquire(blocking_timeout=DEADLINE_S)  # once the first grant expired
    with pytest.raises(LockNotOwnedError):
        await first.release()
    await second.release()


async def test_an_expired_grant_cannot_be_extended(clients: list[Redis]) -> None:
    lock = redlock(clients, timeout=0.3)
    assert await lock.acquire(blocking=False)
    deadline = time.monotonic() + DEADLINE_S
    while lock.validity_s > 0 or await lock.locked():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    with pytest.raises(LockNotOwnedError):
        await lock.extend()
    assert lock.token is None


async def test_works_with_two_nodes_killed(nodes: list[RedisServer], clients: list[Redis]) -> None:
    nodes[0].kill()
    nodes[1].kill()
    lock = redlock(clients)
    assert await lock.acquire(blocking=False)
    assert (await held_by(clients[2:])) == [lock.token] * 3
    assert not await redlock(clients).acquire(blocking=False)
    assert await lock.extend()
    await lock.release()
    assert await held_by(clients[2:]) == [None] * 3


async def test_a_paused_node_costs_only_its_timeout(
    nodes: list[RedisServer], clients: list[Redis]
) -> None:
    nodes[0].kill()
    nodes[1].pause()
    try:
        # A node timeout well above what a loaded machine may take to answer (the
        # release, too, needs three answers within it): the paused node still costs
        # only that, not the 2 s socket timeout or the lock's TTL.
        lock = redlock(clients, node_timeout_s=1.0)
        assert await lock.acquire(blocking=False)
        assert lock.validity_s > 0
        assert await held_by(clients[2:]) == [lock.token] * 3
    finally:
        nodes[1].resume()
    await lock.release()


async def test_fails_with_a_clear_error_with_three_nodes_killed(
    nodes: list[RedisServer], clients: list[Redis]
) -> None:
    for node in nodes[:3]:
        node.kill()
    lock = redlock(clients, timeout=10)
    # Blocking without a time limit: it must still fail, and before a TTL passed.
    with pytest.raises(QuorumUnavailable) as info:
        await asyncio.wait_for(lock.acquire(), timeout=lock.timeout)
    assert "only 2 of 5 nodes answered, 3 needed" in str(info.value)
    assert sorted(info.value.errors) == sorted(f"{n.host}:{n.port}" for n in nodes[:3])
    assert isinstance(info.value, LockError)
    assert await held_by(clients[3:]) == [None, None]
    assert lock.token is None


async def test_a_failed_attempt_is_undone_on_every_node(clients: list[Redis]) -> None:
    for client in clients[:3]:
        await client.set(KEY, b"someone", px=10_000)
    lock = redlock(clients)
    assert not await lock.acquire(blocking=False)
    assert await held_by(clients) == [b"someone"] * 3 + [None] * 2


async def test_a_node_restarted_empty_does_not_vote(
    nodes: list[RedisServer], clients: list[Redis]
) -> None:
    ttl = 2.0

    async def uptime_s(client: Redis) -> int:
        return int((await client.info("server"))["uptime_in_seconds"])

    nodes[3].kill()
    nodes[4].kill()
    holder = Redlock(clients, "res", timeout=ttl, node_timeout_s=0.5)
    # Every node is younger than a TTL: none of them votes yet.
    assert not await holder.acquire(blocking=False)
    assert await holder.acquire(blocking_timeout=DEADLINE_S)
    assert await held_by(clients[:3]) == [holder.token] * 3
    # Nodes 3 and 4 come back empty and grow older than a TTL while the holder
    # keeps its grant alive on nodes 0, 1 and 2.
    nodes[3].restart()
    nodes[4].restart()
    deadline = time.monotonic() + DEADLINE_S
    while min([await uptime_s(c) for c in clients[3:]]) < ttl:
        assert time.monotonic() < deadline
        assert await holder.extend()
        await asyncio.sleep(0.3)
    assert await holder.extend()
    # A longer grant would outlive what a restarted node waits before it votes again.
    with pytest.raises(ConfigError, match="restart_guard"):
        await holder.extend(ttl_s=10 * ttl)
    assert await held_by(clients[:3]) == [holder.token] * 3  # the grant is kept as it was
    # Node 2 restarts empty: the holder's grant survives on nodes 0 and 1 only.
    nodes[2].restart()
    contender = Redlock(clients, "res", timeout=ttl, node_timeout_s=0.5)
    assert not await contender.acquire(blocking=False)  # 3 and 4 say yes, 2 abstains
    assert await held_by(clients) == [holder.token] * 2 + [None] * 3
    # Had node 2 voted, the lock would have been granted a second time.
    unguarded = Redlock(clients, "res", timeout=ttl, node_timeout_s=0.5, restart_guard=False)
    assert await unguarded.acquire(blocking=False)
    assert await held_by(clients) == [holder.token] * 2 + [unguarded.token] * 3
    assert await unguarded.extend(ttl_s=10 * ttl)  # no guard: any TTL
    await unguarded.release()


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"timeout": 0.0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"timeout": math.nan}, "timeout"),
        ({"timeout": math.inf}, "timeout"),
        ({"drift_factor": -0.1}, "drift_factor"),
        ({"drift_factor": math.nan}, "drift_factor"),
        ({"node_timeout_s": 0.0}, "node_timeout_s"),
        ({"node_timeout_s": math.inf}, "node_timeout_s"),
    ],
)
async def test_bad_options_are_config_errors(kwargs: dict[str, Any], what: str) -> None:
    client = Redis()  # never connects: the options are checked first
    try:
        with pytest.raises(ConfigError, match=what) as info:
            Redlock([client], "x", **kwargs)
        assert isinstance(info.value, ValueError)  # what older callers catch
        with pytest.raises(ConfigError, match="at least one"):
            Redlock([], "x")
    finally:
        await client.aclose()
