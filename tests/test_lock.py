"""dedup.lock.Lock on real redis-servers: drop-in behaviour (side by side with redis-py's
Lock), watchdog, reentrancy, fencing, release-signalled waiting, cancellation, and
contention from several OS processes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Connection, Redis
from redis.asyncio.lock import Lock as RedisLock
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError, LockError, LockNotOwnedError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

import dedup.errors
from dedup.errors import ConfigError, InvalidInput, StaleFence
from dedup.lock import RELEASE_CHANNEL, Lock, Redlock, check_fence, fenced_set
from dedup.lock.fence import fence_key, sibling_key
from tests.lock_child import write_fenced
from tests.servers import RedisServer
from tests.slow_proxy import SlowProxy
from tests.test_multiprocess import read_line

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30.0

LEDGER_DDL = """
CREATE TABLE lock_fences (resource text PRIMARY KEY, fence bigint NOT NULL);
CREATE TABLE ledger (resource text PRIMARY KEY, writer text NOT NULL, fence bigint NOT NULL);
"""


# ---------------------------------------------------------------------------- helpers


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def r_decoded(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait (bounded) until ``check()`` is true."""
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S}s: {what}")
        await asyncio.sleep(0.02)


def restartable(url: str, **kwargs: Any) -> Redis:
    """A client whose next command after a server restart reconnects instead of failing."""
    return Redis.from_url(
        url, retry=Retry(NoBackoff(), 3), retry_on_error=[ConnectionError], **kwargs
    )


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def _not(value: Awaitable[bool]) -> bool:
    return not await value


async def subscribers(client: Redis) -> int:
    ((_, n),) = await client.pubsub_numsub(RELEASE_CHANNEL)
    return int(n)


# --------------------------------------------------- drop-in: redis-py's behaviours
# Each behaviour below is one that redis-py's own async lock tests check; both
# classes must show it, through redis.lock(name, lock_class=...).


@pytest.fixture(params=[RedisLock, Lock], ids=["redis-py", "dedup"])
def lock_class(request: pytest.FixtureRequest) -> type[RedisLock]:
    cls: type[RedisLock] = request.param
    return cls


def make(client: Redis, cls: type[RedisLock], name: str = "foo", **kwargs: Any) -> RedisLock:
    return client.lock(name, lock_class=cls, **kwargs)


async def test_key_holds_the_token_as_a_plain_string(r: Redis, lock_class: type[RedisLock]) -> None:
    lock = make(r, lock_class)
    assert await lock.acquire(blocking=False)
    assert await r.type("foo") == b"string"
    assert await r.get("foo") == lock.local.token
    assert await r.ttl("foo") == -1
    await lock.release()
    assert await r.get("foo") is None


@pytest.mark.parametrize("thread_local", [True, False])
async def test_given_token(r: Redis, lock_class: type[RedisLock], thread_local: bool) -> None:
    lock = make(r, lock_class, thread_local=thread_local)
    assert await lock.acquire(blocking=False, token="test")
    assert await r.get("foo") == b"test"
    assert lock.local.token == b"test"
    await lock.release()
    assert await r.get("foo") is None
    assert lock.local.token is None


async def test_locked_and_owned(r: Redis, lock_class: type[RedisLock]) -> None:
    one, two = make(r, lock_class), make(r, lock_class)
    assert not await one.locked()
    assert not await one.owned()
    assert await one.acquire(blocking=False)
    assert await one.locked() and await two.locked()
    assert await one.owned() and not await two.owned()
    await one.release()
    assert not await one.locked() and not await one.owned()
    assert await two.acquire(blocking=False)
    assert not await one.owned() and await two.owned()
    await two.release()


async def test_owned_with_decoded_responses(r_decoded: Redis, lock_class: type[RedisLock]) -> None:
    lock = make(r_decoded, lock_class)
    assert await lock.acquire(blocking=False)
    assert await lock.owned()
    await lock.release()
    assert not await lock.owned()


async def test_competing_locks(r: Redis, lock_class: type[RedisLock]) -> None:
    one, two = make(r, lock_class), make(r, lock_class)
    assert await one.acquire(blocking=False)
    assert not await two.acquire(blocking=False)
    await one.release()
    assert await two.acquire(blocking=False)
    assert not await one.acquire(blocking=False)
    await two.release()


@pytest.mark.parametrize("timeout", [10, 9.5])
async def test_timeout_sets_the_ttl(r: Redis, lock_class: type[RedisLock], timeout: float) -> None:
    lock = make(r, lock_class, timeout=timeout)
    assert await lock.acquire(blocking=False)
    assert 8000 < await r.pttl("foo") <= timeout * 1000
    await lock.release()


async def test_blocking_timeout_gives_up(r: Redis, lock_class: type[RedisLock]) -> None:
    one = make(r, lock_class)
    assert await one.acquire(blocking=False)
    two = make(r, lock_class, sleep=0.05, blocking_timeout=0.2)
    assert not await two.acquire()
    assert not await make(r, lock_class, sleep=60, blocking_timeout=0.3).acquire()
    await one.release()


async def test_blocking_flag(r: Redis, lock_class: type[RedisLock]) -> None:
    assert not make(r, lock_class, blocking=False).blocking
    assert make(r, lock_class).blocking
    holder = make(r, lock_class)
    assert await holder.acquire()
    assert not await make(r, lock_class, blocking=False).acquire()
    await holder.release()


async def test_context_manager(r: Redis, lock_class: type[RedisLock]) -> None:
    async with make(r, lock_class, blocking_timeout=0.2) as lock:
        assert await r.get("foo") == lock.local.token
    assert await r.get("foo") is None
    await r.set("foo", "bar")
    with pytest.raises(LockError):
        async with make(r, lock_class, blocking_timeout=0.1):
            pass


async def test_release_errors(r: Redis, lock_class: type[RedisLock]) -> None:
    lock = make(r, lock_class)
    with pytest.raises(LockError):
        await lock.release()
    assert await lock.acquire(blocking=False)
    await r.set("foo", "a")  # someone else's token now
    with pytest.raises(LockNotOwnedError):
        await lock.release()
    assert lock.local.token is None  # cleared even so


async def test_context_manager_without_raise_on_release_error(
    r: Redis, lock_class: type[RedisLock]
) -> None:
    async with make(r, lock_class, raise_on_release_error=False):
        await r.set("foo", "a")
    assert await r.get("foo") == b"a"


@pytest.mark.parametrize("timeout", [10, 10.0])
async def test_extend(r: Redis, lock_class: type[RedisLock], timeout: float) -> None:
    lock = make(r, lock_class, timeout=timeout)
    assert await lock.acquire(blocking=False)
    assert await lock.extend(10)
    assert 16000 < await r.pttl("foo") <= 20000
    assert await lock.extend(10, replace_ttl=True)
    assert 8000 < await r.pttl("foo") <= 10000
    await lock.release()


async def test_extend_errors(r: Redis, lock_class: type[RedisLock]) -> None:
    with pytest.raises(LockError):
        await make(r, lock_class, timeout=10).extend(10)
    untimed = make(r, lock_class)
    assert await untimed.acquire(blocking=False)
    with pytest.raises(LockError):
        await untimed.extend(10)
    await untimed.release()
    lock = make(r, lock_class, timeout=10)
    assert await lock.acquire(blocking=False)
    await r.set("foo", "a")
    with pytest.raises(LockNotOwnedError):
        await lock.extend(10)


async def test_reacquire(r: Redis, lock_class: type[RedisLock]) -> None:
    lock = make(r, lock_class, timeout=10)
    assert await lock.acquire(blocking=False)
    assert await r.pexpire("foo", 5000)
    assert await lock.reacquire()
    assert 8000 < await r.pttl("foo") <= 10000
    await lock.release()


async def test_reacquire_errors(r: Redis, lock_class: type[RedisLock]) -> None:
    with pytest.raises(LockError):
        await make(r, lock_class, timeout=10).reacquire()
    untimed = make(r, lock_class)
    assert await untimed.acquire(blocking=False)
    with pytest.raises(LockError):
        await untimed.reacquire()
    await untimed.release()
    lock = make(r, lock_class, timeout=10)
    assert await lock.acquire(blocking=False)
    await r.set("foo", "a")
    with pytest.raises(LockNotOwnedError):
        await lock.reacquire()


async def test_release_from_another_task_through_the_same_object(
    r: Redis, lock_class: type[RedisLock]
) -> None:
    lock = make(r, lock_class)
    assert await lock.acquire(blocking=False)
    await asyncio.create_task(lock.release())
    assert await r.get("foo") is None


# ------------------------------------------------------------- dedup's own promises


def test_is_a_redis_py_lock_and_its_errors_are_dedup_errors() -> None:
    assert issubclass(Lock, RedisLock)
    assert issubclass(dedup.errors.LockError, LockError)
    assert issubclass(dedup.errors.LockNotOwned, LockNotOwnedError)
    assert issubclass(dedup.errors.LockNotOwned, dedup.errors.DedupError)


async def test_errors_raised_are_dedup_errors(r: Redis) -> None:
    lock = Lock(r, "foo")
    with pytest.raises(dedup.errors.LockError):
        await lock.release()
    assert await lock.acquire(blocking=False)
    await r.set("foo", "a")
    with pytest.raises(dedup.errors.LockNotOwned):
        await lock.release()


async def test_token_belongs_to_the_object_not_the_thread(r: Redis) -> None:
    lock = Lock(r, "foo", thread_local=True)
    assert await lock.acquire(blocking=False)
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(lock.local.token))
    thread.start()
    thread.join(timeout=DEADLINE_S)
    assert seen == [lock.local.token]  # redis-py's thread-local token would read None
    await lock.release()


def test_import_order_has_no_cycle() -> None:
    import dedup.lock
    import dedup.lock.redlock

    assert dedup.lock.Redlock is dedup.lock.redlock.Redlock
    # Each module imported first, in a fresh interpreter.
    for code in ("import dedup.lock.redlock, dedup.lock", "import dedup.lock, dedup.lock.redlock"):
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=DEADLINE_S)


# ---------------------------------------------------------------------------- fences


async def test_fences_grow_with_every_grant(r: Redis) -> None:
    fences: list[int] = []
    for _ in range(5):
        async with Lock(r, "foo") as lock:
            assert lock.fence is not None
            fences.append(lock.fence)
        assert lock.fence is None  # a fence belongs to a hold
    assert fences == sorted(fences) and len(set(fences)) == 5
    async with Lock(r, "other") as other:
        assert isinstance(other.fence, int)


async def test_no_key_lives_forever(r: Redis) -> None:
    async with Lock(r, "foo", fence_memory_s=5):
        pass
    keys = await r.keys("*")
    assert keys == [b"{foo}:fence"]
    assert 0 < await r.pttl(b"{foo}:fence") <= 5000


async def test_fence_counter_outruns_a_clock_that_stepped_back(r: Redis) -> None:
    async with Lock(r, "foo") as lock:
        first = lock.fence
    assert first is not None
    # As if the fences so far came from a server clock far ahead of this one.
    ahead = first + 10**12
    await r.set(b"{foo}:fence", ahead, px=60_000)
    async with Lock(r, "foo") as lock:
        assert lock.fence == ahead + 1


async def test_fences_grow_across_an_empty_restart(fresh_redis: RedisServer) -> None:
    client = restartable(fresh_redis.url)
    try:
        async with Lock(client, "foo") as lock:
            before = lock.fence
        fresh_redis.restart()
        assert await client.dbsize() == 0
        async with Lock(client, "foo") as lock:
            after = lock.fence
        assert before is not None and after is not None and after > before
    finally:
        await client.aclose()


async def test_fence_scripts_run_where_scripts_replicate_verbatim(
    fresh_redis: RedisServer,
) -> None:
    # Redis 6.x with lua-replicate-commands off refuses a write after TIME or INFO
    # (answers a replica would not share) unless the script replicates its effects.
    # Redis 7+ has no such option (effects always replicate): there the same steps run
    # with the server's only mode, and the redis6 pass (tests/conftest.py) runs them on
    # 6.2 with the option off.
    client = Redis.from_url(fresh_redis.url)
    try:
        with contextlib.suppress(ResponseError):  # Redis 7+: "Unknown option"
            await client.config_set("lua-replicate-commands", "no")
        for options in ({}, {"reentrant": True}):
            async with Lock(client, "v", **options) as lock:
                assert lock.fence is not None
        holder, follower = Lock(client, "h"), Lock(client, "h")
        assert await holder.acquire()
        waiting = asyncio.create_task(follower.acquire(blocking_timeout=DEADLINE_S))
        await eventually(lambda: _is(client.exists(b"{h}:waiting"), 1), "the follower waits")
        await holder.release()  # handed over: a new grant and fence in the release script
        assert await waiting
        await follower.release()
        # The restart guard reads INFO before it grants.
        await eventually(lambda: _uptime_at_least(client, 1), "the node is 1 s old")
        async with Redlock([client], "r", timeout=1):
            pass
    finally:
        await client.aclose()


async def _uptime_at_least(client: Redis, seconds: int) -> bool:
    info = await client.info("server")
    return int(info["uptime_in_seconds"]) >= seconds


@given(st.text(alphabet="abc:{}", min_size=1, max_size=12))
def test_fence_key_shares_the_lock_slot_when_it_can(name: str) -> None:
    key = name.encode()
    counter = fence_key(key)
    start = name.find("{")
    tagged = start >= 0 and name.find("}", start + 1) > start + 1  # Redis's hash tag rule
    if ("{" not in name and "}" not in name) or tagged:
        assert key_slot(counter) == key_slot(key)


async def test_fenced_set_in_redis(r: Redis) -> None:
    await fenced_set(r, "acct", "five", 5)
    await fenced_set(r, "acct", "seven", 7)
    with pytest.raises(StaleFence) as info:
        await fenced_set(r, "acct", "six", 6)
    assert info.value.fence == 6
    await fenced_set(r, "acct", "seven again", 7)  # the same holder may write again
    assert await r.hgetall("acct") == {b"value": b"seven again", b"fence": b"7"}


async def test_check_fence_in_postgresql(pg_empty_url: str) -> None:
    conn = await asyncpg.connect(pg_empty_url)
    try:
        await conn.execute(LEDGER_DDL)
        for fence in (10, 12, 12):
            async with conn.transaction():
                await check_fence(conn, "acct", fence)
        with pytest.raises(StaleFence):
            async with conn.transaction():
                await check_fence(conn, "acct", 11)
        with pytest.raises(InvalidInput):
            await check_fence(conn, "acct", 13)  # outside a transaction guards nothing
        assert await conn.fetchval("SELECT fence FROM lock_fences WHERE resource = 'acct'") == 12
    finally:
        await conn.close()


async def test_a_stale_writer_waits_for_the_newer_one_then_is_rejected(pg_empty_url: str) -> None:
    newer, stale = await asyncpg.connect(pg_empty_url), await asyncpg.connect(pg_empty_url)
    try:
        await newer.execute(LEDGER_DDL)
        await newer.execute("INSERT INTO lock_fences VALUES ('acct', 1)")
        transaction = newer.transaction()
        await transaction.start()
        await check_fence(newer, "acct", 20)

        async def late() -> None:
            async with stale.transaction():
                await check_fence(stale, "acct", 19)

        attempt = asyncio.create_task(late())
        await asyncio.sleep(0.2)  # it is blocked on the row the newer writer locked
        assert not attempt.done()
        await transaction.commit()
        with pytest.raises(StaleFence):
            await asyncio.wait_for(attempt, DEADLINE_S)
    finally:
        await newer.close()
        await stale.close()


# --------------------------------------------------------------------------- watchdog


async def test_watchdog_keeps_a_long_section_alive(r: Redis) -> None:
    lock = Lock(r, "wd", timeout=0.3, watchdog=True)
    assert await lock.acquire(blocking=False)
    await asyncio.sleep(1.2)  # four leases
    assert await lock.owned()
    assert not await Lock(r, "wd").acquire(blocking=False)
    await lock.release()
    assert not lock.lost.is_set()
    await asyncio.sleep(0.4)  # nothing renews a released lock back into existence
    assert not await r.exists("wd")


async def test_watchdog_stops_after_its_cap(r: Redis) -> None:
    lock = Lock(r, "wd", timeout=0.3, watchdog=True, watchdog_cap_s=0.6)
    assert await lock.acquire(blocking=False)
    await asyncio.wait_for(lock.lost.wait(), DEADLINE_S)
    # "lost" comes at the lease's end by the local clock, which starts before the
    # server's: Redis may keep the key a moment longer, never the other way round.
    await eventually(lambda: _not(lock.owned()), "the lease ran out")
    assert await Lock(r, "wd").acquire(blocking=False)


async def test_watchdog_stops_when_the_holding_task_ends(r: Redis) -> None:
    lock = Lock(r, "wd", timeout=0.3, watchdog=True)

    async def hold_and_vanish() -> None:
        assert await lock.acquire(blocking=False)

    await asyncio.create_task(hold_and_vanish())
    # Renewed forever, it would never be free again: this acquire would give up.
    assert await Lock(r, "wd", sleep=0.05).acquire(blocking_timeout=DEADLINE_S)


async def test_watchdog_sees_a_stolen_lock(r: Redis) -> None:
    lock = Lock(r, "wd", timeout=0.6, watchdog=True)
    assert await lock.acquire(blocking=False)
    await r.set("wd", "thief")
    await asyncio.wait_for(lock.lost.wait(), DEADLINE_S)
    assert not await lock.owned()
    with pytest.raises(LockNotOwnedError):
        await lock.release()
    assert await r.get("wd") == b"thief"


async def test_watchdog_sets_lost_by_the_lease_end_while_a_renewal_hangs(
    r: Redis, redis_url: str
) -> None:
    # A partition with redis-py's default socket_timeout (None): the renewal is never
    # answered. "lost" must still come by the lease's end, as the clock says, not
    # whenever (if ever) the renewal returns.
    target = urlsplit(redis_url)
    assert target.hostname is not None and target.port is not None
    async with SlowProxy(target.hostname, target.port) as proxy:
        client = Redis.from_url(proxy.url)
        try:
            lock = Lock(client, "wd", timeout=1, watchdog=True)
            assert await lock.acquire(blocking=False)
            proxy.delay_s = 3600.0  # every reply from now on: as good as never
            stalled = time.monotonic()
            await asyncio.wait_for(lock.lost.wait(), 3)
            assert time.monotonic() - stalled < 1.5  # the lease is 1 s
            # The renewal did reach Redis (only its reply hangs), so the key may live
            # a moment longer; "lost" came first, and then another client takes it.
            assert await Lock(r, "wd").acquire(blocking_timeout=DEADLINE_S)
        finally:
            await client.aclose()


async def test_watchdog_needs_a_lease(r: Redis) -> None:
    with pytest.raises(ValueError, match="timeout"):
        Lock(r, "wd", watchdog=True)
    with pytest.raises(ConfigError, match="timeout"):  # the same error, in dedup's tree
        Lock(r, "wd", watchdog=True)


@pytest.mark.parametrize("memory", [0.0, -1.0, math.nan, math.inf])
async def test_bad_fence_memory_is_a_config_error(r: Redis, memory: float) -> None:
    with pytest.raises(ConfigError, match="fence_memory_s"):
        Lock(r, "x", fence_memory_s=memory)


# ------------------------------------------------------------------------ reentrancy


async def test_reentrant_per_task(r: Redis) -> None:
    outer = Lock(r, "re", reentrant=True, timeout=10)
    inner = Lock(r, "re", reentrant=True)
    assert await outer.acquire(blocking=False)
    assert await outer.acquire(blocking=False)  # the same object again
    assert await inner.acquire(blocking=False)  # another object, same task
    assert inner.fence == outer.fence
    assert await r.hget("re", "count") == b"3"

    async def other_task() -> bool:
        return await Lock(r, "re", reentrant=True).acquire(blocking=False)

    assert not await asyncio.create_task(other_task())
    await inner.release()
    await outer.release()
    assert await outer.owned() and await r.hget("re", "count") == b"1"
    assert not await asyncio.create_task(other_task())
    await outer.release()
    assert not await r.exists("re")
    assert await asyncio.create_task(other_task())


async def test_plain_lock_is_not_reentrant(r: Redis) -> None:
    lock = Lock(r, "foo")
    assert await lock.acquire(blocking=False)
    assert not await lock.acquire(blocking=False)
    await lock.release()


async def test_plain_and_reentrant_exclude_each_other(r: Redis) -> None:
    async with Lock(r, "mix"):
        assert not await Lock(r, "mix", reentrant=True).acquire(blocking=False)
    async with Lock(r, "mix", reentrant=True):
        assert not await Lock(r, "mix").acquire(blocking=False)
        assert not await RedisLock(r, "mix").acquire(blocking=False)


# ----------------------------------------------------------- release-signalled waits


async def test_a_release_wakes_a_waiter(r: Redis) -> None:
    holder = Lock(r, "sig")
    assert await holder.acquire(blocking=False)
    # Polling alone would not look again for 15-45 s.
    waiter = Lock(r, "sig", sleep=30)
    task = asyncio.create_task(waiter.acquire(blocking_timeout=25))
    await eventually(lambda: _is(subscribers(r), 1), "the waiter subscribed")
    await holder.release()
    assert await asyncio.wait_for(task, 10)
    await waiter.release()


async def test_an_expiry_wakes_a_waiter(r: Redis) -> None:
    assert await Lock(r, "sig", timeout=0.5).acquire(blocking=False)  # never released
    waiter = Lock(r, "sig", sleep=30)
    assert await asyncio.wait_for(waiter.acquire(blocking_timeout=25), 10)
    await waiter.release()


async def test_one_subscription_for_all_waiters(r: Redis) -> None:
    names = [f"k{i}" for i in range(5)]
    holders = [Lock(r, name) for name in names]
    for holder in holders:
        assert await holder.acquire(blocking=False)
    done = []

    async def wait_then_release(name: str) -> None:
        lock = Lock(r, name, sleep=30)
        assert await lock.acquire(blocking_timeout=25)
        done.append(name)
        await lock.release()  # wakes the next waiter of that name

    tasks = [asyncio.create_task(wait_then_release(n)) for n in names for _ in range(4)]
    await eventually(lambda: _is(subscribers(r), 1), "one subscription")
    await asyncio.sleep(0.2)
    assert await subscribers(r) == 1
    for holder in holders:
        await holder.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert sorted(done) == sorted(names * 4)
    # Without waiters the subscription ends by itself.
    await eventually(lambda: _is(subscribers(r), 0), "the subscription ended")


async def test_tasks_handing_over_yield_to_another_client(redis_url: str) -> None:
    # Two tasks of one client take turns: each release hands the lock to the other, and
    # the queue of waiters is empty between handovers (each is forgotten then), so the
    # count of handovers in a row must travel with the hold for the holder to yield
    # after 16 to a waiter of another client (another pool: another process, to Redis).
    here, there = Redis.from_url(redis_url), Redis.from_url(redis_url)
    stop = False
    grants = 0

    async def take_turns() -> None:
        nonlocal grants
        while not stop:
            lock = Lock(here, "hot", timeout=10)
            assert await lock.acquire(blocking_timeout=DEADLINE_S)
            grants += 1
            await asyncio.sleep(0.002)
            await lock.release()

    async def warmed_up() -> bool:
        return grants >= 20

    tasks = [asyncio.create_task(take_turns()) for _ in range(2)]
    try:
        await eventually(warmed_up, "the tasks take turns")
        other = Lock(there, "hot", timeout=10)
        started = time.monotonic()
        # 16 handovers take some 40 ms here; the bound is far above that.
        assert await other.acquire(blocking_timeout=3)
        assert time.monotonic() - started < 1.5
        await other.release()
    finally:
        stop = True
        await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
        await here.aclose()
        await there.aclose()


async def test_a_handover_that_failed_halfway_leaves_no_stray_grant(r: Redis) -> None:
    # A fence counter INCR cannot increment makes the handover script fail after it
    # gave the lock to the waiter's token: the holder sees an error (outcome unknown),
    # the waiter no grant. The waiter must not wait out a lease held by its own token.
    holder = Lock(r, "half", timeout=30)
    assert await holder.acquire(blocking=False)
    waiter = Lock(r, "half", timeout=30, sleep=1.0)
    task = asyncio.create_task(waiter.acquire(blocking_timeout=10))
    await eventually(lambda: _is(subscribers(r), 1), "the waiter subscribed")
    await eventually(lambda: _is(r.exists(sibling_key(b"half", b":waiting")), 1), "flagged")
    await asyncio.sleep(0.1)  # its attempt answered; its next one is 0.5-1.5 s away
    await r.set(fence_key(b"half"), b"not a number")
    with pytest.raises(ResponseError):
        await holder.release()
    await r.delete(fence_key(b"half"))  # long before the waiter's next attempt
    started = time.monotonic()
    assert await asyncio.wait_for(task, DEADLINE_S)
    assert time.monotonic() - started < 5  # not the 10 s of giving up, nor the 30 s lease
    assert await r.get("half") == waiter.local.token
    with pytest.raises(LockNotOwnedError):  # the handover had run: not the holder's any more
        await holder.release()
    await waiter.release()


async def test_polling_without_release_signal(r: Redis) -> None:
    holder = Lock(r, "poll")
    assert await holder.acquire(blocking=False)
    waiter = Lock(r, "poll", sleep=0.05, release_signal=False)
    task = asyncio.create_task(waiter.acquire(blocking_timeout=DEADLINE_S))
    await asyncio.sleep(0.2)
    assert await subscribers(r) == 0
    await holder.release()
    assert await asyncio.wait_for(task, DEADLINE_S)


async def test_a_lock_script_is_never_sent_twice_by_the_clients_retry(redis_url: str) -> None:
    """redis-py gives ``Redis(host=...)`` ten retries on timeouts and connection errors,
    each sending the command again. A lock script whose reply is lost after the server
    ran it must not run again: a reentrant release would take the count down twice and
    let another task in while the outer hold still stands."""
    target = urlsplit(redis_url)
    assert target.hostname is not None and target.port is not None
    direct = Redis.from_url(redis_url)
    async with SlowProxy(target.hostname, target.port) as proxy:
        client = Redis(host="127.0.0.1", port=proxy.port, socket_timeout=0.3)
        try:
            warm = Lock(client, "warm", reentrant=True, timeout=30)  # the scripts loaded
            for step in (warm.acquire, warm.acquire, warm.release, warm.release):
                await step()
            outer = Lock(client, "acct", reentrant=True, timeout=30)
            inner = Lock(client, "acct", reentrant=True, timeout=30)
            assert await outer.acquire() and await inner.acquire()
            assert await direct.hget("acct", "count") == b"2"
            # This release's reply comes after the client gave up on it (0.3 s); the
            # connections made after 0.4 s answer at once, so a retry would get through.
            proxy.delay_s = 1.0
            asyncio.get_running_loop().call_later(0.4, setattr, proxy, "delay_s", 0.0)
            with pytest.raises((RedisTimeoutError, ConnectionError)):
                await inner.release()
            assert await direct.hget("acct", "count") == b"1"  # one level down, once
            other = Lock(direct, "acct", reentrant=True, timeout=30)
            assert not await asyncio.ensure_future(other.acquire(blocking=False))
        finally:
            await client.aclose()
            await direct.aclose()


async def test_waiters_survive_a_restarted_server(fresh_redis: RedisServer) -> None:
    client = restartable(fresh_redis.url)
    try:
        assert await Lock(client, "sig").acquire(blocking=False)  # lost with the restart
        waiter = Lock(client, "sig", sleep=0.2)
        task = asyncio.create_task(waiter.acquire(blocking_timeout=DEADLINE_S))
        await eventually(lambda: _is(subscribers(client), 1), "the waiter subscribed")
        fresh_redis.restart()
        assert await asyncio.wait_for(task, DEADLINE_S)
        await waiter.release()
    finally:
        await client.aclose()


# ------------------------------------------------------------------------- batching


class _CountingConnection(Connection):
    """Counts writes to the server."""

    sends = 0

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        _CountingConnection.sends += 1
        await super().send_packed_command(command, check_health)


async def test_lock_calls_of_one_turn_share_a_write(redis_url: str) -> None:
    client = Redis.from_url(redis_url, connection_class=_CountingConnection)
    try:
        async with Lock(client, "warm"):  # the scripts are loaded
            pass
        await client.set(b"{bad}:fence", b"not a number")  # its fence's INCR fails
        locks = [Lock(client, f"batch:{n}") for n in range(8)]
        bad = Lock(client, "bad")
        _CountingConnection.sends = 0
        got = await asyncio.gather(
            *(lk.acquire(blocking=False) for lk in [*locks, bad]), return_exceptions=True
        )
        assert got[:8] == [True] * 8
        assert isinstance(got[8], ResponseError)  # an error reply is its caller's alone
        await bad.settled()  # the half-done grant is given back
        assert _CountingConnection.sends == 2  # the nine acquires, then that give-back
        assert not await client.exists("bad")
        assert len({lk.fence for lk in locks}) == 8
        # A server that lost its scripts: the write, the load, then the calls again,
        # each run once (a release run twice would find its lock gone).
        await client.script_flush()
        _CountingConnection.sends = 0
        await asyncio.gather(*(lk.release() for lk in locks))
        assert _CountingConnection.sends == 3
        assert not await client.exists(*[f"batch:{n}" for n in range(8)])
    finally:
        await client.aclose()


async def test_a_write_whose_callers_all_left_closes_its_connection(
    fresh_redis: RedisServer,
) -> None:
    # As a cancelled redis-py call would: no connection is left waiting for replies
    # nobody reads (a Redlock's call to a paused node times out like this).
    client = Redis.from_url(fresh_redis.url, socket_timeout=None)
    try:
        lock = Lock(client, "left")
        assert await lock.acquire(blocking=False)
        fresh_redis.pause()
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(lock.owned(), 0.2)
        finally:
            fresh_redis.resume()
        assert len(await client.client_list()) == 1
        await lock.release()
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- cancellation


async def test_a_cancelled_release_still_releases(r: Redis) -> None:
    lock = Lock(r, "c")
    assert await lock.acquire(blocking=False)
    task = asyncio.create_task(lock.release())
    await asyncio.sleep(0)  # sent, not answered
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await lock.settled()
    assert lock.local.token is None
    assert not await r.exists("c")


async def test_a_cancelled_release_keeps_a_token_that_still_holds(
    fresh_redis: RedisServer,
) -> None:
    client = Redis.from_url(fresh_redis.url, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    try:
        lock = Lock(client, "c")
        assert await lock.acquire(blocking=False)
        token = lock.local.token
        fresh_redis.pause()
        try:
            task = asyncio.create_task(lock.release())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await lock.settled()  # the release timed out against the paused server
            assert lock.local.token == token
        finally:
            fresh_redis.resume()
        # Either this release works, or the paused server ran the timed-out one
        # when it woke up and this one finds the lock gone: both end the hold.
        with contextlib.suppress(LockNotOwnedError):
            await lock.release()
        assert lock.local.token is None
        assert not await client.exists("c")
    finally:
        await client.aclose()


async def test_a_cancelled_acquire_gives_back_what_it_got(fresh_redis: RedisServer) -> None:
    client = Redis.from_url(fresh_redis.url, socket_timeout=DEADLINE_S)
    try:
        await client.ping()
        lock = Lock(client, "c")
        fresh_redis.pause()
        try:
            task = asyncio.create_task(lock.acquire(blocking=False))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            fresh_redis.resume()  # the server now runs the acquire and grants it
        await lock.settled()
        assert lock.local.token is None
        assert not await client.exists("c")
    finally:
        await client.aclose()


# --------------------------------------------------------------------- processes


def _spawn(job: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.lock_child", json.dumps(job)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


@pytest.mark.parametrize(
    "options",
    [{}, {"reentrant": True, "timeout": 2, "watchdog": True}],
    ids=["plain", "reentrant-watchdog"],
)
async def test_processes_take_turns_with_growing_fences(
    redis_url: str, r: Redis, children: list[subprocess.Popen[str]], options: dict[str, Any]
) -> None:
    processes, tasks, iterations = 4, 2, 20
    job = {
        "mode": "contend",
        "redis_url": redis_url,
        "name": "hot",
        "iterations": iterations,
        "tasks": tasks,
        "options": options,
    }
    children.extend(_spawn(job) for _ in range(processes))
    for p in children:
        assert read_line(p) == "READY"
    for p in children:
        _send(p, "go")
    results = [json.loads(read_line(p, timeout=60)) for p in children]
    assert all(res == {"max_inside": 1, "count": tasks * iterations} for res in results)
    log = [json.loads(entry) for entry in await r.lrange("log", 0, -1)]
    assert len(log) == processes * tasks * iterations
    fences = [fence for fence, _, _ in log]
    assert all(a < b for a, b in itertools.pairwise(fences))  # in entry order
    assert len({pid for _, pid, _ in log}) == processes


async def test_a_killed_holder_frees_the_lock_after_its_lease(
    redis_url: str, r: Redis, children: list[subprocess.Popen[str]]
) -> None:
    job = {
        "mode": "hold",
        "redis_url": redis_url,
        "name": "crash",
        "options": {"timeout": 1, "watchdog": True},
    }
    children.append(_spawn(job))
    first = json.loads(read_line(children[0]))["fence"]
    children[0].kill()
    children[0].wait(timeout=DEADLINE_S)
    lock = Lock(r, "crash", sleep=5)
    assert await lock.acquire(blocking_timeout=DEADLINE_S)
    assert lock.fence is not None and lock.fence > first
    await lock.release()


async def test_a_paused_holders_late_writes_are_rejected(
    redis_url: str, r: Redis, pg_empty_url: str, children: list[subprocess.Popen[str]]
) -> None:
    conn = await asyncpg.connect(pg_empty_url)
    try:
        await conn.execute(LEDGER_DDL)
    finally:
        await conn.close()
    job = {
        "mode": "hold",
        "redis_url": redis_url,
        "database_url": pg_empty_url,
        "resource": "acct",
        "name": "pause",
        "options": {"timeout": 1, "watchdog": True},
    }
    child = _spawn(job)
    children.append(child)
    stale_fence = json.loads(read_line(child))["fence"]
    child.send_signal(signal.SIGSTOP)  # a long GC pause, say: its watchdog stops too
    lock = Lock(r, "pause", timeout=30)
    assert await lock.acquire(blocking_timeout=DEADLINE_S)  # after the child's lease
    assert lock.fence is not None and lock.fence > stale_fence
    assert await write_fenced(r, pg_empty_url, "acct", "parent", lock.fence) == {
        "sql": "written",
        "redis": "written",
    }
    _send(child, "write")  # read when it wakes up, still believing it holds the lock
    child.send_signal(signal.SIGCONT)
    assert json.loads(read_line(child)) == {"sql": "rejected", "redis": "rejected", "owned": False}
    conn = await asyncpg.connect(pg_empty_url)
    try:
        row = await conn.fetchrow("SELECT writer, fence FROM ledger WHERE resource = 'acct'")
    finally:
        await conn.close()
    assert (row["writer"], row["fence"]) == ("parent", lock.fence)
    assert await r.hget("acct", "value") == b"parent"
    await lock.release()
