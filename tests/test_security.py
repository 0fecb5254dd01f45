"""Security, one test each: the bearer token (and its constant-time compare), Redis over
TLS (``rediss://``), Redis AUTH with an ACL user, secrets kept out of logs and error
bodies, size limits, and Redis keys made of digests only.

Everything runs against real processes: redis-server (also with TLS only, certificates
made with ``openssl`` at test time), PostgreSQL, and ``python -m dedup`` subprocesses.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote, urlencode

import aiohttp
import asyncpg
import orjson
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from dedup import ConfigError, Gateway, InvalidInput, Unavailable
from dedup._claims.keys import KeySpace, MarkerLayout
from dedup._claims.protocol import Claims
from dedup._engine.shared_wire import sink_id
from dedup._redis.connect import connect_redis
from dedup._redis.script import exchange
from dedup._values import digest
from dedup.metrics import Stats
from dedup.service.app import _authorized
from dedup.service.http import Request
from tests.servers import RedisServer, free_port
from tests.test_mux import mux_of, packed
from tests.test_service import (
    ROOT,
    ServiceProcess,
    assert_error,
    request,
    service_env,
    spawn_service,
    wait_exit,
    wait_healthy,
)
from tests.tls import TlsRedisServer, make_certs

TOKEN = "sec-" + secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "Content-Type": "application/json"}
# Passwords with the characters a URL parser trips on, in their URL-escaped form too.
PASSWORD = "pw/" + secrets.token_hex(6) + "@x"
PASSWORD_IN_URL = quote(PASSWORD, safe="")
# A "#" or "?" ends a URL's authority early for every parser: "Port could not be cast
# to integer value as '<the password's first piece>'".
PASSWORD_HASH = "pw" + secrets.token_hex(6) + "#" + secrets.token_hex(6) + "?x"
CLI_TIMEOUT_S = 60.0

# The minimal command set dedup needs as an ACL user (docs/security.md): INFO for the
# eviction guard, EVALSHA / SCRIPT LOAD for the claim scripts and the commands they run,
# PING for /readyz, on the keys of its namespace only.
MINIMAL_ACL = tuple(
    # The Security page's minimal user, word for word (a test of the documentation too).
    [
        "~dedup:*",
        "&dedup:*",
        "+evalsha",
        "+script|load",
        "+info",
        "+ping",
        "+get",
        "+set",
        "+pexpire",
        "+pexpireat",
        "+pttl",
        "+del",
        "+exists",
        "+type",
        "+time",
        "+hget",
        "+hset",
        "+hexists",
        "+hincrby",
        "+getdel",
        "+getbit",
        "+setbit",
        "+zadd",
        "+zcard",
        "+zrem",
        "+zremrangebyscore",
        "+rpush",
        "+llen",
        "+lrange",
        "+ltrim",
        "+blpop",
        "+publish",
        "+subscribe",
    ]
)


@pytest.fixture
async def service(redis_url: str, pg_url: str, tmp_path: Path) -> AsyncIterator[ServiceProcess]:
    """A service with a token and small limits, on the session's servers."""
    env = service_env(
        redis_url,
        pg_url,
        DEDUP_AUTH_TOKEN=TOKEN,
        DEDUP_MAX_BODY_BYTES="4096",
        DEDUP_MAX_BATCH_ITEMS="10",
        DEDUP_MAX_VALUE_BYTES="100",
        DEDUP_MAX_PAYLOAD_BYTES="200",
    )
    svc = spawn_service(tmp_path, env)
    try:
        await wait_healthy(svc)
        yield svc
        svc.terminate()
        assert await wait_exit(svc) == 0, svc.log_text()
    finally:
        if svc.proc.poll() is None:
            svc.kill()


async def count_rows(database_url: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        n: int = await conn.fetchval("SELECT count(*) FROM dedup_items")
    finally:
        await conn.close()
    return n


# -------------------------------------------------------------------------------- auth


async def test_bearer_token_missing_wrong_and_right(service: ServiceProcess, pg_url: str) -> None:
    body = orjson.dumps({"kind": "auth", "value": "v"})
    flipped_first = chr(ord(TOKEN[0]) ^ 1) + TOKEN[1:]
    flipped_last = TOKEN[:-1] + ("0" if TOKEN[-1] != "0" else "1")
    refused = [
        {},  # no header
        {"Authorization": f"Bearer {flipped_first}"},  # same length, first character wrong
        {"Authorization": f"Bearer {flipped_last}"},  # same length, last character wrong
        {"Authorization": f"Bearer {TOKEN[:-1]}"},  # a prefix
        {"Authorization": f"Bearer {TOKEN}{TOKEN}"},  # longer
        {"Authorization": f"Basic {TOKEN}"},  # another scheme
        {"Authorization": TOKEN},  # no scheme
    ]
    async with aiohttp.ClientSession(base_url=service.url) as http:
        for headers in refused:
            for path, data in (("/v1/save", body), ("/v1/save/batch", b'{"items": []}')):
                status, answer, response_headers = await request(
                    http,
                    "POST",
                    path,
                    body=data,
                    headers={**headers, "Content-Type": "application/json"},
                )
                assert status == 401, (headers, answer)
                assert_error(status, answer, "unauthorized")
                assert response_headers["WWW-Authenticate"].startswith("Bearer")
                assert TOKEN not in orjson.dumps(answer).decode()
            status, _, _ = await request(http, "GET", "/metrics", headers=headers)
            assert status == 401
        assert await count_rows(pg_url) == 0
        status, answer, _ = await request(http, "POST", "/v1/save", body=body, headers=JSON)
        assert (status, answer) == (201, {"created": True, "source": "write"})
        async with http.get("/metrics", headers=AUTH) as r:
            assert r.status == 200
        for path in ("/healthz", "/readyz", "/openapi.json"):  # open: they reveal nothing
            status, _, _ = await request(http, "GET", path)
            assert status == 200, path
    assert TOKEN not in service.log_text()


def test_token_compare_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token check goes through hmac.compare_digest, and refuses every near miss."""
    token = TOKEN.encode()
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)

    def check(header: str) -> bool:
        return _authorized(Request("POST", b"/v1/save", {"authorization": header}, "-"), token)

    assert check(f"Bearer {TOKEN}") and check(f"bearer {TOKEN}")
    # Every same-length token that differs in one character, at every position.
    for i, char in enumerate(TOKEN):
        wrong = TOKEN[:i] + ("a" if char != "a" else "b") + TOKEN[i + 1 :]
        assert len(wrong) == len(TOKEN)
        assert not check(f"Bearer {wrong}"), wrong
    assert not check("Bearer ") and not check(f"Bearer {TOKEN}x") and not check(f"Token {TOKEN}")
    assert not check("Bearer " + "\N{LATIN SMALL LETTER E WITH ACUTE}" * len(TOKEN))  # non-ASCII
    compared = len(TOKEN) + 2 + 3  # the calls above that reach the compare
    assert len(seen) == compared and all(b == token for _, b in seen)


# --------------------------------------------------------------------------------- TLS


async def test_rediss_tls(tmp_path: Path, pg_url: str) -> None:
    certs = make_certs(tmp_path / "certs")
    with TlsRedisServer(certs) as server:
        url = server.url
        assert url.startswith("rediss://127.0.0.1:") and "ssl_ca_certs=" in url
        async with Gateway(url, pg_url) as gw:
            first = await gw.save("tls", "over TLS", payload={"t": 1})
            assert (first.created, first.source) == (True, "write")
            assert await gw.ping() == {"redis": True, "database": True}
        async with Gateway(url, pg_url, local_cache_size=0) as gw:
            again = await gw.save("tls", "over TLS")
            assert (again.created, again.source) == (False, "redis")  # the marker went over TLS
        # The server speaks TLS only, and the client checks who it talks to.
        plain = f"redis://127.0.0.1:{server.port}/0"
        no_ca = f"rediss://127.0.0.1:{server.port}/0"
        no_client_cert = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={certs.ca}"
        for bad in (plain, no_ca, no_client_cert):
            with pytest.raises(Unavailable) as caught:
                async with Gateway(bad, pg_url, redis_timeout_s=2.0, require_redis=True):
                    pass
            assert caught.value.component == "redis", caught.value
        assert "CERTIFICATE_VERIFY_FAILED" in await open_error(no_ca, pg_url)
        # TLS options on a plain redis:// URL: a clear ConfigError, not a TypeError.
        with pytest.raises(ConfigError, match="rediss://"):
            async with Gateway(url.replace("rediss://", "redis://"), pg_url):
                pass
        # `dedup check` reaches it the same way.
        done = await run_cli("check", "--redis-url", url, "--database-url", pg_url)
        assert "reachable, Redis 7" in done.stdout, done.stdout + done.stderr


async def open_error(url: str, pg_url: str, **options: Any) -> str:
    """The message of the error that opening a Gateway on ``url`` raises."""
    try:
        async with Gateway(url, pg_url, redis_timeout_s=2.0, require_redis=True, **options):
            pass
    except (Unavailable, ConfigError) as exc:
        return str(exc)
    raise AssertionError(f"{url} opened")


async def run_cli(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m dedup *args``, bounded, off the event loop."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "dedup", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        env=service_env("", ""),
    )


# --------------------------------------------------------------------------------- ACL


def test_security_page_names_the_minimal_acl_user() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    assert "ACL SETUSER dedup on >PASSWORD " + " ".join(MINIMAL_ACL) + "\n" in page


async def test_redis_acl_user(fresh_redis: RedisServer, pg_url: str) -> None:
    admin = aioredis.Redis.from_url(fresh_redis.url)
    try:
        await admin.script_flush()  # the ACL user must be able to load the scripts itself
        no_info = [rule for rule in MINIMAL_ACL if rule != "+info"]
        for user, rules in (
            ("dedup", MINIMAL_ACL),
            ("noinfo", no_info),
            ("elsewhere", ("~other:*", "+@all")),
        ):
            await admin.execute_command(  # type: ignore[no-untyped-call]
                "ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules
            )
    finally:
        await admin.aclose()

    def url(user: str, password: str = PASSWORD_IN_URL) -> str:
        return fresh_redis.url.replace("redis://", f"redis://{user}:{password}@")

    async with Gateway(url("dedup"), pg_url) as gw:
        assert (await gw.save("acl", "a")).created
        assert await gw.ping() == {"redis": True, "database": True}
    async with Gateway(url("dedup"), pg_url, local_cache_size=0) as gw:
        assert (await gw.save("acl", "a")).source == "redis"

    # No +info: the eviction guard cannot read maxmemory-policy. A ConfigError saying
    # what to grant, or, with the documented override, a warning and a working Gateway.
    message = await open_error(url("noinfo"), pg_url)
    assert "+info" in message and "allow_eviction" in message, message
    async with Gateway(url("noinfo"), pg_url, allow_eviction=True) as gw:
        assert (await gw.save("acl", "b")).created

    # A wrong password, or a user whose keys are elsewhere: typed errors, no secret.
    wrong = secrets.token_hex(8)
    message = await open_error(url("dedup", wrong), pg_url)
    assert "***" in message and wrong not in message, message
    async with Gateway(url("elsewhere"), pg_url) as gw:
        with pytest.raises(Unavailable):
            await gw.save("acl", "c")
    for text in (message,):
        assert PASSWORD not in text and PASSWORD_IN_URL not in text


async def test_rediss_shared_connection(tmp_path: Path) -> None:
    """rediss:// with the URL's CA and client certificate: calls and a subscription go
    over TLS on the shared connection; a client that does not trust the server's
    certificate cannot connect."""
    certs = make_certs(tmp_path / "certs")
    with TlsRedisServer(certs) as server:
        r = connect_redis(server.url, max_connections=4, timeout_s=2)
        assert isinstance(r, aioredis.Redis)
        try:
            heard: list[bytes] = []
            subscription = await mux_of(r).subscribe(["t"], lambda _, data: heard.append(data))
            try:
                assert await exchange(r.connection_pool, packed(("SET", "k", "tls")), 1) == [b"OK"]
                await exchange(r.connection_pool, packed(("PUBLISH", "t", "hello")), 1)
                async with asyncio.timeout(10):
                    while not heard:
                        await asyncio.sleep(0.01)
                assert heard == [b"hello"]
            finally:
                subscription.close()
            assert await r.get("k") == b"tls"  # redis-py's own TLS connection reads it
        finally:
            await r.aclose()
        no_ca = urlencode({"ssl_certfile": certs.client_cert, "ssl_keyfile": certs.client_key})
        untrusted = connect_redis(
            f"rediss://{server.host}:{server.port}/0?{no_ca}", max_connections=4, timeout_s=2
        )
        assert isinstance(untrusted, aioredis.Redis)
        try:
            with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                await exchange(untrusted.connection_pool, packed(("PING",)), 1, retry=False)
        finally:
            await untrusted.aclose()


# ----------------------------------------------------------------------------- secrets


async def test_secrets_never_in_logs_or_error_messages(
    redis_url: str, pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Failing connections, through the library, `dedup check`, `dedup migrate` and
    `dedup serve`: the password appears in no message, log line or output."""
    dead = free_port()
    secret_redis = f"redis://dedup:{PASSWORD_IN_URL}@127.0.0.1:{dead}/0"
    secret_pg = f"postgresql://postgres:{PASSWORD_IN_URL}@127.0.0.1:{dead}/dedup"
    query_pg = f"postgresql://postgres@127.0.0.1:{dead}/dedup?password={PASSWORD_IN_URL}"
    # Not percent-encoded, as users write them: the URL splits in the wrong places.
    raw_redis = f"redis://dedup:{PASSWORD}@127.0.0.1:{dead}/0"
    raw_pg = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{dead}/dedup"
    hash_pg = f"postgresql://postgres:{PASSWORD_HASH}@127.0.0.1:{dead}/dedup"
    texts: list[str] = []

    caplog.set_level(logging.DEBUG)
    for redis_url_, db_url in (
        (secret_redis, pg_url),
        (redis_url, secret_pg),
        (redis_url, query_pg),
        (raw_redis, pg_url),
        (redis_url, raw_pg),
        (redis_url, hash_pg),
    ):
        texts.append(await open_error(redis_url_, db_url))
    texts.append(caplog.text)

    check = await run_cli("check", "--redis-url", secret_redis, "--database-url", secret_pg)
    assert check.returncode != 0 and "cannot connect" in check.stdout, check.stdout
    texts += [check.stdout, check.stderr]
    check = await run_cli("check", "--redis-url", raw_redis, "--database-url", raw_pg)
    assert check.returncode != 0 and "percent-encode" in check.stdout, check.stdout
    texts += [check.stdout, check.stderr]
    check = await run_cli("check", "--redis-url", redis_url, "--database-url", hash_pg)
    assert check.returncode != 0 and "percent-encode" in check.stdout, check.stdout
    texts += [check.stdout, check.stderr]
    for db_url in (secret_pg, query_pg, raw_pg, hash_pg):
        migrate = await run_cli("migrate", "--database-url", db_url)
        assert migrate.returncode == 2, migrate.stderr
        assert "could not migrate" in migrate.stderr or "percent-encode" in migrate.stderr
        texts += [migrate.stdout, migrate.stderr]
    for redis_url_, db_url in (
        (secret_redis, pg_url),
        (redis_url, secret_pg),
        (raw_redis, pg_url),
        (redis_url, hash_pg),
    ):
        env = service_env(
            redis_url_, db_url, DEDUP_AUTH_TOKEN=TOKEN, DEDUP_LOG_LEVEL="debug",
            DEDUP_REQUIRE_REDIS="true",
        )  # fmt: skip
        svc = spawn_service(tmp_path, env)
        status = await wait_exit(svc, timeout=CLI_TIMEOUT_S)
        assert status != 0
        texts.append(svc.log_text())
    # Without require_redis it serves degraded, and logs every failed probe: no secret.
    env = service_env(secret_redis, pg_url, DEDUP_AUTH_TOKEN=TOKEN, DEDUP_LOG_LEVEL="debug")
    svc = spawn_service(tmp_path, env)
    try:
        deadline = asyncio.get_running_loop().time() + CLI_TIMEOUT_S
        while "Redis probe failed" not in svc.log_text():
            assert asyncio.get_running_loop().time() < deadline, svc.log_text()
            await asyncio.sleep(0.1)
    finally:
        svc.stop()
    assert "starting degraded" in svc.log_text()
    texts.append(svc.log_text())

    assert all(texts[:5]) and "***" in texts[0]
    pieces = [p for p in re.split(r"[/@#?]", PASSWORD + "/" + PASSWORD_HASH) if len(p) >= 2]
    for text in texts:
        for secret in (PASSWORD, PASSWORD_IN_URL, PASSWORD_HASH, TOKEN, *pieces):
            assert secret not in text, (secret, text)


# ------------------------------------------------------------------------------ limits


async def test_size_limits(service: ServiceProcess, redis_url: str, pg_url: str) -> None:
    """Body (413), batch, value and payload sizes (422) over HTTP; InvalidInput in the library."""
    async with aiohttp.ClientSession(base_url=service.url) as http:
        cases: list[tuple[str, Any, int, str | None]] = [
            ("/v1/save", {"kind": "lim", "value": "v" * 5000}, 413, None),
            (
                "/v1/save/batch",
                {"items": [{"kind": "lim", "value": str(i)} for i in range(11)]},
                422,
                "items",
            ),
            ("/v1/save", {"kind": "lim", "value": "v" * 101}, 422, "value"),
            ("/v1/save", {"kind": "lim", "value": "\N{EURO SIGN}" * 34}, 422, "value"),  # 102 bytes
            ("/v1/save", {"kind": "lim", "value": "v", "payload": "p" * 199}, 422, "payload"),
            ("/v1/save", {"kind": "k" * 129, "value": "v"}, 422, "kind"),
        ]
        for path, body, expected, field in cases:
            status, answer, _ = await request(
                http, "POST", path, body=orjson.dumps(body), headers=JSON
            )
            assert status == expected, (path, answer)
            error = assert_error(
                status, answer, "body_too_large" if status == 413 else "invalid_input"
            )
            if field is not None:
                assert error["field"] == field
        # At the limits: accepted.
        at_limits = {"kind": "k" * 128, "value": "v" * 100, "payload": "p" * 198}
        status, answer, _ = await request(
            http, "POST", "/v1/save", body=orjson.dumps(at_limits), headers=JSON
        )
        assert status == 201, answer
    assert await count_rows(pg_url) == 1
    async with Gateway(redis_url, pg_url, max_value_bytes=100, max_payload_bytes=200) as gw:
        for kind, value, payload, field in (
            ("lim", "v" * 101, None, "value"),
            ("lim", "v", "p" * 199, "payload"),
        ):
            with pytest.raises(InvalidInput) as caught:
                await gw.save(kind, value, payload)
            assert caught.value.field == field
        with pytest.raises(InvalidInput) as caught:
            await gw.save_many([("lim", "ok"), ("lim", "v" * 101)])
        assert (caught.value.index, caught.value.field) == (1, "value")
    assert await count_rows(pg_url) == 1


# -------------------------------------------------------------------------------- keys


async def _redis_contents(client: aioredis.Redis) -> dict[bytes, tuple[bytes, list[bytes]]]:
    """Every key of the server, its type and every byte string it holds (a string's
    value; a hash's fields and values; a list's entries; a set's members)."""
    out: dict[bytes, tuple[bytes, list[bytes]]] = {}
    async for key in client.scan_iter(count=1000):
        kind: Any = await client.type(key)
        held: Any
        if kind == b"string":
            held = [await client.get(key)]
        elif kind == b"hash":
            held = [b for pair in (await client.hgetall(key)).items() for b in pair]
        elif kind == b"list":
            held = await client.lrange(key, 0, -1)
        elif kind == b"zset":
            held = await client.zrange(key, 0, -1)
        elif kind == b"set":
            held = list(await client.smembers(key))
        else:
            raise AssertionError(f"unexpected Redis type {kind!r} of {key!r}")
        out[key] = (kind, held)
    return out


async def test_redis_keys_are_digests_only(redis_url: str, pg_url: str) -> None:
    """After saves (and a lease left by a failed write), no Redis key or stored string
    holds a value's or a kind's text: markers are fields of buckets named after the
    namespace and a digest-derived index, each field a slice of the value's digest
    (XOR the kind's), holding "1"; no lease key is left.

    Writes here are per process (``shared_writes="off"``): the shared write queue
    carries values while rows wait (see
    :func:`test_shared_write_queue_holds_values_while_rows_wait`)."""
    kinds = ["customer-email", "card-number"]
    values = [f"alice.{i}@example.com-{secrets.token_hex(4)}" for i in range(50)]

    async def refuse(rows: Any) -> list[tuple[str, bytes]]:
        raise RuntimeError("the sink is down")

    async with Gateway(redis_url, pg_url, namespace="dedup", shared_writes="off") as gw:
        await gw.save_many([(k, v, {"note": v}) for k in kinds for v in values])
    async with Gateway(
        redis_url, sink=refuse, namespace="other-ns", lease_ms=60_000, shared_writes="off"
    ) as gw:
        with pytest.raises(Unavailable):
            await gw.save("customer-email", values[0])
    client = aioredis.Redis.from_url(redis_url)
    try:
        contents = await _redis_contents(client)
        space = KeySpace("dedup")
        value_keys = [space.key(k, digest(v)) for k in kinds for v in values]
        claims = Claims(client, lease_ms=1, retention_ms=0, stats=Stats())
        states = await claims.states(value_keys)
    finally:
        await client.aclose()
    assert states == "S" * len(value_keys)  # every value saved, in the compact layout
    # Exactly the buckets and fields the digests give, one field per value; nothing
    # else: the failed write released its lease, no per-value key is left.
    layout = MarkerLayout()
    expected: dict[bytes, set[bytes]] = {}
    for key in value_keys:
        (bucket,), field = layout.locate(key)
        expected.setdefault(bucket, set()).add(field)
    assert sum(len(fields) for fields in expected.values()) == len(value_keys)
    assert set(contents) == set(expected)
    texts = [t.encode() for t in kinds + values] + [t.encode()[:8] for t in values]
    for bucket, (kind, held) in contents.items():
        assert kind == b"hash", (bucket, kind)
        assert re.fullmatch(rb"dedup:m:[0-9]+", bucket), bucket
        fields, markers = held[0::2], held[1::2]
        assert set(fields) == expected[bucket]
        assert all(len(f) == layout.field_bytes == 10 for f in fields), fields
        assert set(markers) == {b"1"}, markers  # saved markers: no text of the caller's
        for text in texts:
            assert text not in bucket
            for f in fields:
                assert text not in f


async def test_shared_write_queue_holds_values_while_rows_wait(redis_url: str) -> None:
    """KNOWN, reported: with shared writes (``shared_writes="on"``, or ``"auto"`` with more
    than one gateway alive), a winner's row waits in the list ``<ns>:{w}:queue`` for the
    fleet's writer, and each entry (after the prefix naming its lease) is JSON holding the
    kind, the value and the payload in clear. So while rows wait, Redis does hold callers'
    values: the promise of
    :func:`test_redis_keys_are_digests_only` is kept only with ``shared_writes="off"``
    (or a single gateway under "auto"). Once the rows are written, the queue is empty
    (gone) and Redis again holds no text of the caller's. This test documents the
    behaviour; it fails once the queue no longer carries values in clear."""
    kind = "customer-email"
    values = [f"bob.{i}@example.com-{secrets.token_hex(4)}" for i in range(3)]
    release = asyncio.Event()
    calls: list[list[Any]] = []

    async def held(rows: Any) -> list[tuple[str, bytes]]:
        calls.append(list(rows))
        await release.wait()
        return [(r.kind, r.digest) for r in rows]

    held.identity = "a test table"  # type: ignore[attr-defined]  # shared writes need one

    async def until(what: str, check: Any) -> None:
        for _ in range(500):
            if await check():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    async def sink_calls(n: int) -> bool:
        return len(calls) >= n

    client = aioredis.Redis.from_url(redis_url)
    prefix = b"dedup:{w}:" + sink_id("a test table", b"").encode()
    queue_key, writer_key = prefix + b":queue", prefix + b":writer"
    tasks: list[asyncio.Task[Any]] = []
    options: dict[str, Any] = {
        "sink": held,
        "shared_writes": "on",
        "max_batch": 1,
        "lease_ms": 60_000,
        "wait_timeout_s": 120,  # time to wait for the writer, then write it here
    }
    try:
        # One row per statement: the writer keeps two statements in flight, so with
        # both held in the sink a third row stays queued. The rows are another
        # gateway's: the writer's own winners join its statements without the queue.
        async with Gateway(redis_url, **options) as writer:

            async def writer_stands() -> bool:
                return bool(await client.exists(writer_key))

            await until("the gateway to stand as the shared writer", writer_stands)
            async with Gateway(redis_url, **options) as gw:

                async def queues() -> bool:  # listening for the writer's words
                    shared = gw._engine.shared if gw._engine is not None else None
                    return shared is not None and shared.active

                await until("the other gateway to queue its rows", queues)
                for n, value in enumerate(values[:2], start=1):
                    tasks.append(asyncio.create_task(gw.save(kind, value, {"note": value})))
                    await until(f"statement {n} in the sink", lambda n=n: sink_calls(n))

                async def queued() -> bool:
                    return bool(await client.llen(queue_key))

                tasks.append(asyncio.create_task(gw.save(kind, values[2], {"note": values[2]})))
                await until("a row waiting in the queue", queued)
                entries = await client.lrange(queue_key, 0, -1)
                assert len(entries) == 1
                # <key length: 2 bytes><lease key><queued token>|<mac>|<JSON>
                raw = cast(bytes, entries[0])
                message = raw[2 + int.from_bytes(raw[:2], "big") :].partition(b"|")[2]
                entry = orjson.loads(message.partition(b"|")[2])
                # [format, sink, gateway id, nonce, token, lease key hex, kind, value, payload]
                assert entry[6] == kind
                assert entry[7] == values[2]  # the value itself, in Redis
                assert values[2].encode() in entries[0]
                release.set()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert writer.stats().shared_statements == 3
        assert [(r.created, r.source) for r in results] == [(True, "write")] * 3
        contents = await _redis_contents(client)
    finally:
        release.set()
        for task in tasks:
            task.cancel()
        await client.aclose()
    assert queue_key not in contents  # drained: a list with no entries is no key
    texts = [kind.encode()] + [v.encode() for v in values] + [v.encode()[:8] for v in values]
    for key, (_, held_bytes) in contents.items():
        for text in texts:
            assert text not in key, key
            assert all(text not in b for b in held_bytes), (key, held_bytes)
