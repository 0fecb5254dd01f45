"""The shared connection of dedup's Redis clients (dedup._redis.mux) on a real
redis-server: replies in order under concurrency, cancelled and timed-out calls, a
restart, a password and a database, subscriptions, and the pools it leaves alone."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from dedup._redis.connect import MuxPool, connect_redis
from dedup._redis.mux import Mux
from dedup._redis.packing import pack
from dedup._redis.script import exchange
from dedup.testing.servers import RedisServer
from tests.slow_proxy import SlowProxy


def packed(*commands: tuple[object, ...]) -> bytes:
    out = b"".join(p for p in (pack(c) for c in commands) if p is not None)
    assert out
    return out


@pytest.fixture
async def client(fresh_redis: RedisServer) -> AsyncIterator[Redis]:
    r = connect_redis(fresh_redis.url, max_connections=8, timeout_s=0.5)
    assert isinstance(r, Redis)
    try:
        yield r
    finally:
        await r.aclose()


def mux_of(client: Redis) -> Mux:
    pool = client.connection_pool
    assert isinstance(pool, MuxPool) and pool.mux is not None
    return pool.mux


async def test_concurrent_calls_get_their_own_replies_in_order(client: Redis) -> None:
    """500 calls in flight at once, each of several commands: every caller gets exactly
    the replies of its own commands, error replies as redis-py's exceptions, in place."""
    pool = client.connection_pool

    async def one(i: int) -> None:
        replies = await exchange(
            pool,
            packed(
                ("SET", f"k{i}", f"v{i}"),
                ("GET", f"k{i}"),
                ("EVALSHA", "0" * 40, 0),
                ("INCRBY", "n", i),
            ),
            4,
        )
        assert replies[:2] == [b"OK", f"v{i}".encode()]
        assert isinstance(replies[2], NoScriptError)
        assert isinstance(replies[3], int)

    await asyncio.gather(*(one(i) for i in range(500)))
    assert int(await client.get("n") or 0) == sum(range(500))
    # One connection served them all (and the pool's own connections none of them).
    assert (await client.info("clients"))["connected_clients"] == 2  # the mux + this INFO


async def test_a_cancelled_call_leaves_the_stream_in_step(
    client: Redis, fresh_redis: RedisServer
) -> None:
    """A caller cancelled while its reply is on the way: its reply is read and dropped,
    and the next caller gets its own."""
    mux = mux_of(client)
    await mux.call(packed(("PING",)), 1)  # connected
    fresh_redis.pause()
    try:
        slow = asyncio.ensure_future(mux.call(packed(("SET", "a", "1"), ("GET", "a")), 2))
        await asyncio.sleep(0.05)
        slow.cancel()
        after = asyncio.ensure_future(mux.call(packed(("SET", "b", "2"), ("GET", "b")), 2))
        await asyncio.sleep(0.05)
    finally:
        fresh_redis.resume()
    assert await after == [b"OK", b"2"]
    assert slow.cancelled()
    assert await client.get("a") == b"1"  # the cancelled call's commands ran


async def test_a_timeout_fails_every_call_in_flight_then_reconnects(
    client: Redis, fresh_redis: RedisServer
) -> None:
    """A stalled server: the oldest call times out after the socket timeout, and every
    call behind it fails with it (TimeoutError, which the client's Retry does not send
    again); once the server is back, the next call connects again and succeeds."""
    mux = mux_of(client)
    await mux.call(packed(("PING",)), 1)
    fresh_redis.pause()
    try:
        calls = [asyncio.ensure_future(mux.call(packed(("PING",)), 1)) for _ in range(5)]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*calls, return_exceptions=True), timeout=10
        )
    finally:
        fresh_redis.resume()
    assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes
    assert await asyncio.wait_for(exchange(client.connection_pool, packed(("PING",)), 1), 10) == [
        b"PONG"
    ]


async def test_a_restarted_server_is_reached_again(client: Redis, fresh_redis: RedisServer) -> None:
    """After a restart the closed connection is replaced before the next write: a call
    that may not be sent twice (``retry=False``) succeeds too."""
    pool = client.connection_pool
    assert await exchange(pool, packed(("SET", "x", "1")), 1) == [b"OK"]
    fresh_redis.restart()
    await asyncio.sleep(0.2)  # the loop reads the old connection's end
    assert await exchange(pool, packed(("PING",)), 1, retry=False) == [b"PONG"]


async def test_a_killed_server_fails_calls_with_connection_error(
    client: Redis, fresh_redis: RedisServer
) -> None:
    mux = mux_of(client)
    await mux.call(packed(("PING",)), 1)
    fresh_redis.pause()
    call = asyncio.ensure_future(mux.call(packed(("PING",)), 1))
    await asyncio.sleep(0.05)
    fresh_redis.kill()
    with pytest.raises((ConnectionError, TimeoutError)):
        await asyncio.wait_for(call, 10)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(mux.call(packed(("PING",)), 1), 10)


async def test_password_user_and_database(fresh_redis: RedisServer) -> None:
    """AUTH (with a user, or the default user's password) and SELECT as the URL says,
    before any caller's command; a wrong password is a ConnectionError naming no secret."""
    secret = "s3cret-Pw"
    admin = Redis(host=fresh_redis.host, port=fresh_redis.port)
    await admin.execute_command("ACL", "SETUSER", "app", "on", f">{secret}", "~*", "+@all")  # type: ignore[no-untyped-call]

    async def check(user: str, password: str) -> None:
        url = f"redis://{user}:{password}@127.0.0.1:{fresh_redis.port}/3"
        r = connect_redis(url, max_connections=4, timeout_s=2)
        assert isinstance(r, Redis)
        try:
            await exchange(r.connection_pool, packed(("SET", "who", user or "-")), 1)
            assert await r.get("who") == (user or "-").encode()  # the same database, 3
        finally:
            await r.aclose()

    try:
        await check("app", secret)
        with pytest.raises(ConnectionError) as caught:
            await check("app", "nope-wrong")
        assert secret not in str(caught.value) and "nope-wrong" not in str(caught.value)
        await admin.config_set("requirepass", secret)  # AUTH <password>, the default user
        await admin.execute_command("AUTH", secret)  # type: ignore[no-untyped-call]
        await check("", secret)
    finally:
        await admin.aclose()


async def test_unix_socket(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("sock")
    path = os.path.join(folder, "r.sock")
    if len(path) > 100:  # the kernel's limit on a socket's path
        path = f"/tmp/dedup-mux-{os.getpid()}.sock"
    with RedisServer(extra_args=["--unixsocket", path, "--unixsocketperm", "700"]):
        r = connect_redis(f"unix://{path}", max_connections=4, timeout_s=2)
        assert isinstance(r, Redis)
        try:
            assert mux_of(r) is not None
            assert await exchange(r.connection_pool, packed(("PING",)), 1) == [b"PONG"]
        finally:
            await r.aclose()


async def test_subscription(client: Redis, fresh_redis: RedisServer) -> None:
    """Live when subscribe() returns; every message handed over in order; ``lost`` once
    the server goes."""
    heard: list[tuple[bytes, bytes]] = []
    subscription = await mux_of(client).subscribe(
        ["a", "b"], lambda channel, data: heard.append((channel, data))
    )
    try:
        for i in range(100):
            await client.publish("a" if i % 2 else "b", str(i))
        async with asyncio.timeout(10):
            while len(heard) < 100:
                await asyncio.sleep(0.01)
        assert heard == [(b"a" if i % 2 else b"b", str(i).encode()) for i in range(100)]
        assert not subscription.lost.done()
        fresh_redis.kill()
        await asyncio.wait_for(asyncio.shield(subscription.lost), 10)
    finally:
        subscription.close()


async def test_closing_the_client_closes_the_shared_connection(
    fresh_redis: RedisServer,
) -> None:
    r = connect_redis(fresh_redis.url, max_connections=4, timeout_s=2)
    assert isinstance(r, Redis)
    await exchange(r.connection_pool, packed(("CLIENT", "SETNAME", "muxed")), 1)
    await r.aclose()
    probe = Redis(host=fresh_redis.host, port=fresh_redis.port)
    try:
        async with asyncio.timeout(10):
            while b"name=muxed" in await probe.execute_command("CLIENT", "LIST"):  # type: ignore[no-untyped-call]
                await asyncio.sleep(0.02)
    finally:
        await probe.aclose()


def test_pools_it_cannot_serve_keep_redis_pys_connections() -> None:
    """RESP3 (and a credential provider) stay on redis-py's own connections."""
    r = connect_redis("redis://127.0.0.1:6390/0?protocol=3", max_connections=4, timeout_s=1)
    assert isinstance(r, Redis)
    assert isinstance(r.connection_pool, MuxPool) and r.connection_pool.mux is None


# ------------------------------------------------------- found in review, each a fix


async def test_a_connection_the_server_closes_at_once_fails_fast(
    fresh_redis: RedisServer,
) -> None:
    """A server at ``maxclients`` accepts, says why and closes: the call fails at once
    with a ConnectionError carrying the server's words, not after the socket timeout."""
    admin = Redis(host=fresh_redis.host, port=fresh_redis.port)
    await admin.config_set("maxclients", 1)  # this admin connection is the one
    # Directly, the refusal may arrive before the PING is written or after it (then as
    # its reply); through a proxy that holds every reply 0.2 s, always after.
    proxy = await SlowProxy(fresh_redis.host, fresh_redis.port, delay_s=0.2).start()
    try:
        for url in (fresh_redis.url, proxy.url):
            r = connect_redis(url, max_connections=4, timeout_s=5)
            assert isinstance(r, Redis)
            try:
                started = asyncio.get_running_loop().time()
                with pytest.raises(ConnectionError, match="max number of clients"):
                    await exchange(r.connection_pool, packed(("PING",)), 1)
                assert asyncio.get_running_loop().time() - started < 4
            finally:
                await r.aclose()
    finally:
        await proxy.aclose()
        await admin.config_set("maxclients", 10000)
        await admin.aclose()


async def clients_named(server: RedisServer, name: str) -> int:
    probe = Redis(host=server.host, port=server.port)
    try:
        listing = await probe.execute_command("CLIENT", "LIST")  # type: ignore[no-untyped-call]
        return sum(f"name={name} ".encode() in line for line in listing.splitlines())
    finally:
        await probe.aclose()


async def test_a_handshake_cut_short_leaves_no_connection(fresh_redis: RedisServer) -> None:
    """A connect whose SELECT / SETNAME times out (a stopped server) closes its socket:
    once the server is back, no connection of it is left there."""
    url = fresh_redis.url + "/1?client_name=cutshort"
    r = connect_redis(url, max_connections=4, timeout_s=0.3)
    assert isinstance(r, Redis)
    fresh_redis.pause()
    try:
        for _ in range(3):
            with pytest.raises(TimeoutError):
                await exchange(r.connection_pool, packed(("PING",)), 1)
    finally:
        fresh_redis.resume()
        await r.aclose()
    await asyncio.sleep(0.3)  # the server reads the resets of the pending connections
    assert await clients_named(fresh_redis, "cutshort") == 0


async def test_closing_while_connecting_leaves_no_connection(fresh_redis: RedisServer) -> None:
    """aclose() while a first call is still connecting: that call fails, and no
    connection is made for a client already closed."""
    url = fresh_redis.url + "/1?client_name=latecomer"
    r = connect_redis(url, max_connections=4, timeout_s=5)
    assert isinstance(r, Redis)
    fresh_redis.pause()
    try:
        call = asyncio.ensure_future(exchange(r.connection_pool, packed(("PING",)), 1))
        await asyncio.sleep(0.1)  # connected; its SELECT waits for the stopped server
        await asyncio.wait_for(r.aclose(), 10)
    finally:
        fresh_redis.resume()
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(call, 10)
    await asyncio.sleep(0.3)
    assert await clients_named(fresh_redis, "latecomer") == 0
    assert mux_of(r)._protocol is None


async def test_closing_with_unsent_bytes_to_a_stopped_server_returns(
    fresh_redis: RedisServer,
) -> None:
    """A stopped server and a socket full of unsent bytes: aclose() returns at once
    (the connection is aborted, not flushed) and the call fails."""
    r = connect_redis(fresh_redis.url, max_connections=4, timeout_s=30)
    assert isinstance(r, Redis)
    await exchange(r.connection_pool, packed(("PING",)), 1)
    fresh_redis.pause()
    try:
        big = asyncio.ensure_future(
            exchange(r.connection_pool, packed(("SET", "big", "x" * (64 << 20))), 1)
        )
        await asyncio.sleep(0.2)
        await asyncio.wait_for(r.aclose(), 10)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(big, 10)
    finally:
        fresh_redis.resume()


async def test_a_subscribe_an_acl_refuses_is_the_servers_error(fresh_redis: RedisServer) -> None:
    """NOPERM on SUBSCRIBE is Redis saying no (a ResponseError), not Redis being down
    (a ConnectionError counts against the circuit)."""
    admin = Redis(host=fresh_redis.host, port=fresh_redis.port)
    try:
        await admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "nochan", "on", ">pw", "~*", "+@all", "resetchannels"
        )
    finally:
        await admin.aclose()
    r = connect_redis(
        fresh_redis.url.replace("redis://", "redis://nochan:pw@"), max_connections=4, timeout_s=2
    )
    assert isinstance(r, Redis)
    try:
        with pytest.raises(ResponseError) as caught:
            await mux_of(r).subscribe(["a"], lambda channel, data: None)
        assert not isinstance(caught.value, ConnectionError)
    finally:
        await r.aclose()
