"""The Idempotency-Key middlewares on real servers: Starlette on uvicorn (dedup.asgi),
aiohttp (dedup.aiohttp) and Flask on a threading wsgiref server (dedup.wsgi on a
SyncGateway), each rule for each of the three; requests over real HTTP on 127.0.0.1,
Redis and PostgreSQL real too. The apps are in tests/middleware_apps.py."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from multidict import CIMultiDictProxy

import dedup._idempotency
import dedup.aiohttp
import dedup.asgi
import dedup.wsgi
from dedup import Gateway, InvalidInput
from dedup._idempotency import Idempotency, json_fingerprint
from tests.middleware_apps import FRAMEWORKS, count_runs, serve
from tests.test_once import forget

DEADLINE_S = 60.0
ROOT = Path(__file__).resolve().parent.parent

Build = Callable[..., Awaitable[str]]  # build(**middleware options) -> base URL


@dataclass
class Setup:
    """One framework's server factory and the runs file its handler writes."""

    framework: str
    build: Build
    runs: Path

    def count(self, body: str | None = None) -> int:
        return count_runs(self.runs, body)


@pytest.fixture(params=FRAMEWORKS)
async def app(
    request: pytest.FixtureRequest, redis_url: str, pg_url: str, tmp_path: Path
) -> AsyncIterator[Setup]:
    """Each test runs against the three middlewares."""
    closers: list[Callable[[], Awaitable[None]]] = []
    runs = tmp_path / "runs"

    async def build(**options: Any) -> str:
        base, close = await serve(request.param, redis_url, pg_url, runs, options)
        closers.append(close)
        return base

    try:
        yield Setup(request.param, build, runs)
    finally:
        for close in closers:
            await close()


@dataclass
class Answer:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def replayed(self) -> bool:
        return self.headers.get("Idempotent-Replayed") == "true"


async def call(
    base: str,
    key: str | None = None,
    body: str = "{}",
    *,
    method: str = "POST",
    path: str = "/orders",
    headers: dict[str, str] | None = None,
    **query: Any,
) -> Answer:
    sent = dict(headers or {})
    if key is not None:
        sent["Idempotency-Key"] = key
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.request(
            method,
            f"{base}{path}",
            data=body.encode(),
            headers=sent,
            params={k: str(v) for k, v in query.items()},
        ) as r,
    ):
        return Answer(r.status, r.headers, await r.read())


def assert_problem(answer: Answer, status: int, error: str) -> None:
    assert answer.status == status
    assert answer.headers["Content-Type"] == "application/problem+json"
    problem = answer.json()
    assert problem["status"] == status and problem["error"] == error
    assert problem["type"] == "about:blank" and problem["title"] and problem["detail"]


async def test_a_retry_gets_the_first_response_replayed(app: Setup) -> None:
    base = await app.build(replay_headers=["X-Run"])
    first = await call(base, "k-1", "a")
    assert first.status == 201 and not first.replayed
    for key in ("k-1", '"k-1"'):  # the draft's quoted form is the same key
        again = await call(base, key, "a")
        assert again.status == 201 and again.replayed
        assert again.body == first.body  # the same bytes: the handler did not run
        for name in ("Content-Type", "Location", "X-Run"):
            assert again.headers[name] == first.headers[name]
        assert "X-Other" in first.headers and "X-Other" not in again.headers
    assert app.count() == 1
    # Another key runs; requests without a key, and unguarded methods, pass through.
    assert (await call(base, "k-2", "b")).body != first.body
    assert (await call(base, None, "c")).status == 201
    assert (await call(base, None, "c")).status == 201
    get = await call(base, "k-1", "a", method="GET")
    assert get.status == 201 and not get.replayed
    assert app.count() == 5
    # PATCH is guarded by default.
    patched = await call(base, "k-3", "d", method="PATCH")
    assert (await call(base, "k-3", "d", method="PATCH")).body == patched.body
    assert app.count() == 6


async def test_a_reused_key_with_another_request_is_a_422(app: Setup) -> None:
    base = await app.build()
    assert (await call(base, "k", "a")).status == 201
    assert_problem(await call(base, "k", "b"), 422, "key_mismatch")  # another body
    assert_problem(await call(base, "k", "a", path="/other"), 422, "key_mismatch")
    assert_problem(await call(base, "k", "a", method="PATCH"), 422, "key_mismatch")
    assert_problem(await call(base, "k", "a", extra=1), 422, "key_mismatch")  # query
    assert (await call(base, "k", "a")).replayed
    assert app.count() == 1


async def test_the_fingerprint_is_configurable(app: Setup) -> None:
    base = await app.build(kind="orders", fingerprint=json_fingerprint(ignore=["sent_at"]))
    first = await call(base, "k", '{"item": 1, "sent_at": 10}')
    # Another timestamp and another field order: the same request.
    again = await call(base, "k", '{"sent_at": 11, "item": 1}')
    assert again.replayed and again.body == first.body
    assert_problem(await call(base, "k", '{"item": 2, "sent_at": 10}'), 422, "key_mismatch")
    # Without a fingerprint a reused key is replayed whatever the body.
    unchecked = await app.build(kind="loose", fingerprint=None)
    first = await call(unchecked, "k", "x")
    assert (await call(unchecked, "k", "y")).body == first.body
    assert app.count() == 2


async def test_a_key_in_flight_gets_409_with_retry_after(app: Setup) -> None:
    base = await app.build(retry_after_s=2)
    slow = asyncio.create_task(call(base, "k", "a", sleep=1.5))
    async with asyncio.timeout(DEADLINE_S):
        while app.count() == 0:
            await asyncio.sleep(0.01)
    busy = await call(base, "k", "a", sleep=1.5)
    assert_problem(busy, 409, "in_progress")
    assert busy.headers["Retry-After"] == "2"
    first = await slow
    assert first.status == 201 and not first.replayed
    again = await call(base, "k", "a", sleep=1.5)
    assert again.replayed and again.body == first.body
    assert app.count() == 1


async def test_in_flight_wait_replays_to_concurrent_retries(app: Setup) -> None:
    base = await app.build(in_flight="wait")
    answers = await asyncio.gather(*(call(base, "k", "a", sleep=0.5) for _ in range(6)))
    assert {(a.status, a.body) for a in answers} == {(201, answers[0].body)}
    assert sorted(a.replayed for a in answers) == [False] + [True] * 5
    assert app.count() == 1


async def test_5xx_and_exceptions_are_never_stored(app: Setup) -> None:
    base = await app.build()
    steps = "500,503,x,201"
    assert (await call(base, "k", "a", statuses=steps)).status == 500
    assert (await call(base, "k", "a", statuses=steps)).status == 503
    assert (await call(base, "k", "a", statuses=steps)).status == 500  # the handler raised
    done = await call(base, "k", "a", statuses=steps)
    assert done.status == 201 and not done.replayed
    again = await call(base, "k", "a", statuses=steps)
    assert again.replayed and again.body == done.body
    assert app.count() == 4


async def test_4xx_is_stored_unless_it_says_try_again(app: Setup) -> None:
    base = await app.build()
    first = await call(base, "k", "a", statuses="400,201")
    assert first.status == 400
    again = await call(base, "k", "a", statuses="400,201")
    assert (again.status, again.body, again.replayed) == (400, first.body, True)
    for status in (408, 409, 425, 429):  # never stored: the retry runs
        body = f"s{status}"
        assert (await call(base, body, body, statuses=f"{status},201")).status == status
        assert (await call(base, body, body, statuses=f"{status},201")).status == 201
        assert app.count(body) == 2
    # store_4xx=False: no 4xx is stored.
    strict = await app.build(kind="strict", store_4xx=False)
    assert (await call(strict, "k", "b", statuses="404,201")).status == 404
    assert (await call(strict, "k", "b", statuses="404,201")).status == 201
    assert app.count("a") == 1 and app.count("b") == 2


async def test_require_key_answers_400_on_the_guarded_methods(app: Setup) -> None:
    base = await app.build(require_key=True, methods=["POST"])
    assert_problem(await call(base, None, "a"), 400, "missing_key")
    assert_problem(await call(base, "  ", "a"), 400, "missing_key")  # empty
    assert app.count() == 0
    assert (await call(base, None, "b", method="PATCH")).status == 201  # not guarded here
    assert (await call(base, None, "b", method="GET")).status == 201
    assert (await call(base, "k", "c")).status == 201
    assert app.count() == 3


async def test_keys_are_scoped(app: Setup) -> None:
    def tenant(request: Any) -> str | None:
        if isinstance(request, dict) and "headers" in request:  # the ASGI scope
            found = dict(request["headers"]).get(b"x-tenant")
            return None if found is None else found.decode()
        if isinstance(request, dict):  # the WSGI environ
            value: str | None = request.get("HTTP_X_TENANT")
            return value
        header: str | None = request.headers.get("X-Tenant")  # aiohttp's Request
        return header

    base = await app.build(scope=tenant)
    a = await call(base, "k", "x", headers={"X-Tenant": "a"})
    b = await call(base, "k", "x", headers={"X-Tenant": "b"})
    assert a.body != b.body and not b.replayed  # two tenants, two keys
    again = await call(base, "k", "x", headers={"X-Tenant": "a"})
    assert again.replayed and again.body == a.body
    assert app.count() == 2
    # A request without a scope cannot spell tenant a's key "k" ("1:a:k" is how the
    # scoped key is stored): it is a key of its own, and runs.
    unscoped = await call(base, "1:a:k", "x")
    assert unscoped.status == 201 and not unscoped.replayed and unscoped.body != a.body
    assert (await call(base, "1:a:k", "x")).body == unscoped.body
    assert (await call(base, "k", "x", headers={"X-Tenant": "a"})).body == a.body
    assert app.count() == 3


def test_scoped_and_unscoped_keys_never_meet() -> None:
    scoped = Idempotency(scope=lambda request: None)
    assert scoped.value("3:abc:x", None) != scoped.value("x", "abc") == "3:abc:x"
    assert scoped.value("k", None) == scoped.value("k", "") == "0::k"
    assert scoped.value("0::k", None) != scoped.value("k", None)
    with pytest.raises(InvalidInput):
        scoped.value("k", 1)  # type: ignore[arg-type]
    # Without a scope function the key is the value, as the keys stored so far are.
    assert Idempotency().value("3:abc:x", None) == "3:abc:x"


async def test_a_body_over_the_cap_replays_status_and_headers(app: Setup, pg_url: str) -> None:
    base = await app.build(max_response_bytes=100)
    first = await call(base, "big", "a", pad=500)
    assert first.status == 201 and len(first.body) > 500
    again = await call(base, "big", "a", pad=500)
    assert again.replayed and again.headers["Idempotent-Body-Omitted"] == "true"
    assert (again.status, again.body) == (201, b"")
    assert again.headers["Location"] == first.headers["Location"]
    small = await call(base, "small", "b")
    assert "Idempotent-Body-Omitted" not in (await call(base, "small", "b")).headers
    stored = await payloads(pg_url, "request")
    assert stored["big"]["body"] is None
    assert stored["small"]["body"].encode() == small.body
    assert stored["small"]["status"] == 201 and len(stored["small"]["fp"]) == 64
    assert app.count() == 2


async def test_a_key_whose_row_was_deleted_runs_the_handler_again(app: Setup, pg_url: str) -> None:
    """A key forgotten by deleting its row, while the Redis marker (kept forever by
    default) and the local tier still say it is saved, runs the handler again: no
    made-up 200 with an empty body and Idempotent-Replayed. (Without the replay cache:
    with it, the rule is the next test's.)"""
    base = await app.build(kind="orders", replay_cache_size=0)
    first = await call(base, "k", "a")
    assert first.status == 201 and (await call(base, "k", "a")).replayed
    await forget(pg_url, "orders")
    second = await call(base, "k", "a")  # this process's local tier says saved
    assert second.status == 201 and not second.replayed and second.body != first.body
    assert "Idempotent-Body-Omitted" not in second.headers
    again = await call(base, "k", "a")
    assert again.replayed and again.body == second.body
    await forget(pg_url, "orders")
    fresh = await app.build(kind="orders", replay_cache_size=0)  # only Redis says saved
    third = await call(fresh, "k", "a")
    assert third.status == 201 and not third.replayed and third.body != second.body
    assert (await call(base, "k", "a")).body == third.body
    assert app.count() == 3


async def test_a_deleted_row_is_replayed_from_the_cache_for_replay_cache_s_at_most(
    app: Setup, pg_url: str
) -> None:
    """A row deleted by SQL: the replay cache may replay it for a moment, then the
    tombstone's drain forgets the key in every process (a request meanwhile may get 409
    while the key is held); the next request runs the handler, once."""
    base = await app.build(kind="orders", replay_cache_s=1.0)
    first = await call(base, "k", "a")  # stored, and cached as it is stored
    await forget(pg_url, "orders")
    cached = await call(base, "k", "a")
    assert cached.replayed and cached.body == first.body
    deadline = asyncio.get_running_loop().time() + 30
    while True:  # bounded: the drain's bound is a few seconds
        rerun = await call(base, "k", "a")
        if not rerun.replayed or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.2)
    while rerun.status == 409 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)  # held by the drain for about a second
        rerun = await call(base, "k", "a")
    assert rerun.status == 201 and not rerun.replayed and rerun.body != first.body
    assert (await call(base, "k", "a")).body == rerun.body
    assert app.count() == 2


async def test_a_cached_replay_reads_no_database(app: Setup, pg_url: str) -> None:
    """A key stored (or read back) by this process is replayed from its cache: with the
    table gone, its replays and its 422 are still answered, a key not cached gets 503."""
    base = await app.build(kind="orders")
    first = await call(base, "stored", "a")
    other = await app.build(kind="orders")  # another Gateway: its cache is filled by a read
    assert (await call(other, "stored", "a")).replayed
    ingest = await app.build(kind="events", mode="ingest")
    assert (await call(ingest, "e", "a")).status == 201
    conn = await asyncpg.connect(pg_url)
    try:  # from now on every read of the table fails
        await conn.execute("ALTER TABLE dedup_items RENAME TO dedup_items_gone")
    finally:
        await conn.close()
    for server in (base, other):
        again = await call(server, "stored", "a")
        assert (again.status, again.body, again.replayed) == (201, first.body, True)
        assert_problem(await call(server, "stored", "b"), 422, "key_mismatch")
    repeat = await call(ingest, "e", "b")
    assert (repeat.status, repeat.json()) == (200, {"duplicate": True})
    assert_problem(await call(base, "not-cached", "a"), 503, "unavailable")
    assert app.count() == 2


async def test_the_replay_cache_is_bounded(redis_url: str, pg_url: str) -> None:
    """At most ``replay_cache_size`` entries and ``replay_cache_bytes`` bytes, the least
    recently used dropped first; nothing cached without the key in the local tier."""
    async with Gateway(redis_url, pg_url) as gw:
        rules = Idempotency(replay_cache_size=3, replay_cache_bytes=4000)

        async def store(key: str, body: bytes) -> None:
            lease = await rules.claim(gw, key, None)
            assert not isinstance(lease, dedup._idempotency.Response)
            await rules.settle(gw, lease, 201, (("Content-Type", "text/plain"),), body, None)

        for i in range(10):
            await store(f"k{i}", b"x")
            assert len(rules.cache) <= 3 and rules.cache.nbytes <= 4000
        assert rules.cached(gw, "k0", None) is None  # evicted
        for i in (7, 8, 9):
            answer = rules.cached(gw, f"k{i}", None)
            assert answer is not None and answer.body == b"x"
        for i in range(3):  # 1,000 bytes each: three do not fit in 4,000 with the rest
            await store(f"big{i}", b"y" * 1000)
            assert rules.cache.nbytes <= 4000
        assert len(rules.cache) == 2
        await store("huge", b"z" * 5000)  # over the byte bound alone: never cached
        assert rules.cached(gw, "huge", None) is None
        assert rules.cache.nbytes <= 4000
        # Whatever drops a key from the local tier drops its cache entry (purge, here).
        assert rules.cached(gw, "big2", None) is not None
        await gw.purge(["request"])
        assert rules.cached(gw, "big2", None) is None
        off = Idempotency(replay_cache_size=0)
        lease = await off.claim(gw, "off", None)
        assert not isinstance(lease, dedup._idempotency.Response)
        await off.settle(gw, lease, 201, (), b"x", None)
        assert len(off.cache) == 0 and off.cached(gw, "off", None) is None


async def test_a_key_saved_without_a_record_is_not_replayed(
    app: Setup, redis_url: str, pg_url: str
) -> None:
    """A key saved by a plain save of the kind has no response to replay: a 422 says
    so, rather than a made-up empty 200 (an older record's status is still replayed)."""
    async with Gateway(redis_url, pg_url) as gw:
        assert (await gw.save("orders", "plain")).created
        assert (await gw.save("orders", "old", {"status": 202})).created
    base = await app.build(kind="orders")
    assert_problem(await call(base, "plain", "a"), 422, "key_mismatch")
    old = await call(base, "old", "a")
    assert (old.status, old.body, old.replayed) == (202, b"", True)
    assert app.count() == 0


async def test_a_store_that_fails_is_a_503_that_names_it_without_details(
    app: Setup, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    base = await app.build(kind="orders")
    assert (await call(base, "k", "a")).status == 201
    conn = await asyncpg.connect(pg_url)
    try:  # the database now fails every read of the table, with a driver error
        await conn.execute("ALTER TABLE dedup_items RENAME TO dedup_items_gone")
    finally:
        await conn.close()
    with caplog.at_level(logging.WARNING, logger="dedup"):
        answer = await call(base, "k2", "a")
    assert_problem(answer, 503, "unavailable")
    assert answer.headers["Retry-After"] == "1"
    assert answer.json()["detail"] == "the database is unavailable; retry later"
    assert "dedup_items" in caplog.text  # the driver's message is logged, not sent
    assert app.count() == 1
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("ALTER TABLE dedup_items_gone RENAME TO dedup_items")
    finally:
        await conn.close()
    # The claim that the failed read came with was given back: the retry runs the
    # handler at once, rather than 409 until the lease expires.
    assert (await call(base, "k2", "a")).status == 201
    assert app.count() == 2


async def payloads(pg_url: str, kind: str) -> dict[str, Any]:
    """The stored records of ``kind``, by key."""
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch("SELECT value, payload FROM dedup_items WHERE kind = $1", kind)
    finally:
        await conn.close()
    return {row["value"]: orjson.loads(row["payload"]) for row in rows}


async def test_ingest_mode_drops_repeats_without_storing_a_body(app: Setup, pg_url: str) -> None:
    base = await app.build(kind="events", mode="ingest", duplicate_status=202)
    first = await call(base, "e-1", "a")
    assert first.status == 201
    repeat = await call(base, "e-1", "another body: no fingerprint in ingest mode")
    assert (repeat.status, repeat.json()) == (202, {"duplicate": True})
    # Only a 2xx is stored: a 4xx is not a reason to drop the repeat.
    assert (await call(base, "e-2", "b", statuses="400,201")).status == 400
    assert (await call(base, "e-2", "b", statuses="400,201")).status == 201
    assert await payloads(pg_url, "events") == {
        "e-1": {"v": 1, "status": 201},
        "e-2": {"v": 1, "status": 201},
    }
    assert app.count() == 3


async def test_bad_keys_and_bodies_are_typed_problems(app: Setup) -> None:
    base = await app.build(max_request_bytes=10)
    assert_problem(await call(base, "k", "x" * 11), 413, "body_too_large")
    nul = await app.build(kind="nul", key=lambda request: "bad\x00key")
    assert_problem(await call(nul, None, "a"), 400, "invalid_key")
    # Longer than the Gateway's max_value_bytes (servers refuse such a header already).
    long = await app.build(kind="long", key=lambda request: "k" * 9000)
    assert_problem(await call(long, None, "a"), 400, "invalid_key")
    assert app.count() == 0


async def test_concurrent_retries_from_several_processes(
    redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    """Three server processes per framework, one Redis and PostgreSQL: concurrent
    retries of one key run the handler once and all get its bytes; a 500 is retried
    on another process and runs again."""
    children: list[subprocess.Popen[str]] = []
    try:
        for framework in FRAMEWORKS:
            runs = tmp_path / f"runs-{framework}"
            options = orjson.dumps({"kind": framework, "in_flight": "wait"}).decode()
            bases = []
            for _ in range(3):
                child = subprocess.Popen(
                    [sys.executable, "-m", "tests.middleware_child", framework, redis_url,
                     pg_url, str(runs), options],
                    cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                children.append(child)
                bases.append(child)
            urls = await asyncio.gather(*(asyncio.to_thread(_url_of, c) for c in bases))
            answers = await asyncio.gather(
                *(call(urls[i % 3], "same", "a", sleep=0.5) for i in range(12))
            )
            assert {(a.status, a.body) for a in answers} == {(201, answers[0].body)}, framework
            assert sum(not a.replayed for a in answers) == 1
            assert count_runs(runs, "a") == 1
            # A 500 is not stored: the retry on another process runs the handler again.
            steps = "500,201"
            assert (await call(urls[0], "retry", "b", statuses=steps)).status == 500
            second = await call(urls[1], "retry", "b", statuses=steps)
            assert second.status == 201 and not second.replayed
            third = await call(urls[2], "retry", "b", statuses=steps)
            assert third.replayed and third.body == second.body
            assert count_runs(runs, "b") == 2
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
        for child in children:
            try:
                child.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()


def _url_of(child: subprocess.Popen[str]) -> str:
    assert child.stdout is not None
    line = child.stdout.readline()  # the child prints its URL, or dies (EOF)
    assert line.startswith("URL "), f"the server process did not start: {line!r}"
    return line.split()[1]


def test_bad_options_are_typed() -> None:
    gw = Gateway("redis://127.0.0.1:1", "postgresql://u@127.0.0.1:1/db")  # never opened

    async def inner(scope: Any, receive: Any, send: Any) -> None: ...

    bad: list[dict[str, Any]] = [
        {"kind": ""},
        {"header": ""},
        {"key": "header"},
        {"scope": 1},
        {"mode": "drop"},
        {"in_flight": "queue"},
        {"methods": "POST"},
        {"replay_headers": "X-Run"},
        {"require_key": 1},
        {"store_4xx": "no"},
        {"max_response_bytes": -1},
        {"max_request_bytes": 0},
        {"duplicate_status": 409},
        {"retry_after_s": 1.5},
        {"replay_cache_size": -1},
        {"replay_cache_bytes": 1.5},
        {"replay_cache_s": 0},
        {"replay_cache_s": float("inf")},
    ]
    for options in bad:
        with pytest.raises(InvalidInput):
            dedup.aiohttp.middleware(gw, **options)
        with pytest.raises(InvalidInput):
            dedup.asgi.DedupMiddleware(inner, gateway=gw, **options)
    with pytest.raises(InvalidInput):
        dedup.aiohttp.middleware("not a gateway")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        dedup.wsgi.DedupMiddleware(lambda e, s: [], gateway=gw)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        json_fingerprint(ignore="sent_at")


async def test_concurrent_new_keys_each_run_once_and_replay(app: Setup) -> None:
    """Many requests with new keys at once (their reads and rows batched together): each
    runs the handler once, and each key's retry replays its own first answer."""
    base = await app.build(kind="orders")
    keys = [f"k-{i}" for i in range(30)]
    # Five connections at a time: wsgiref's listen backlog is five, and a connection
    # past it waits for the client's SYN retransmission (seconds on a busy box).
    slots = asyncio.Semaphore(5)

    async def limited(key: str) -> Answer:
        async with slots:
            return await call(base, key, key)

    async with asyncio.timeout(DEADLINE_S):
        firsts = await asyncio.gather(*(limited(key) for key in keys))
        retries = await asyncio.gather(*(limited(key) for key in keys))
    assert all(a.status == 201 and not a.replayed for a in firsts)
    assert len({a.body for a in firsts}) == len(keys)
    assert [(a.status, a.body, a.replayed) for a in retries] == [
        (201, a.body, True) for a in firsts
    ]
    assert app.count() == len(keys)


async def test_concurrent_new_keys_share_statements(redis_url: str, pg_url: str) -> None:
    """N requests with new keys in flight at once read their rows in a few statements and
    store their responses in a few INSERTs (the Gateway's statement count), not 2N."""
    n = 64
    async with Gateway(redis_url, pg_url) as gw:
        rules = Idempotency(kind="orders")

        async def request(key: str) -> None:
            lease = await rules.claim(gw, key, None)
            assert not isinstance(lease, dedup._idempotency.Response)
            kept = (("Content-Type", "text/plain"),)
            await rules.settle(gw, lease, 201, kept, key.encode(), None)

        before = gw.stats()
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*(request(f"k{i}") for i in range(n)))
        after = gw.stats()
        assert after.db_rows_sent - before.db_rows_sent == n
        assert 1 <= after.db_statements - before.db_statements < n // 4
        assert after.db_errors == before.db_errors
        for i in range(n):
            answer = rules.cached(gw, f"k{i}", None)
            assert answer is not None and answer.body == f"k{i}".encode()
        assert len(await payloads(pg_url, "orders")) == n


async def test_asgi_sends_the_last_message_after_the_store_and_in_order(
    redis_url: str, pg_url: str
) -> None:
    """The ASGI middleware hands the server the response's messages in the app's order, the
    last one only once the key's row is in the database; an app that goes on after its
    last message (a background task) and then raises still has its answer stored and
    sent, and its exception reaches the server."""
    sent: list[tuple[MutableMapping[str, Any], int]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await send({"type": "http.response.body", "body": b"two"})
        await asyncio.sleep(0.05)  # a background task, after the answer
        raise RuntimeError("the background task failed")

    async with Gateway(redis_url, pg_url) as gw:
        middleware = dedup.asgi.DedupMiddleware(app, gateway=gw, kind="orders")
        scope = {"type": "http", "method": "POST", "path": "/o", "query_string": b"",
                 "headers": [(b"idempotency-key", b"k1")]}  # fmt: skip

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append((message, len(await payloads(pg_url, "orders"))))

        async with asyncio.timeout(DEADLINE_S):
            with pytest.raises(RuntimeError, match="background task"):
                await middleware(scope, receive, send)
        bodies = [m.get("body") for m, _ in sent]
        assert [m["type"] for m, _ in sent] == [
            "http.response.start", "http.response.body", "http.response.body"
        ]  # fmt: skip
        assert bodies == [None, b"one ", b"two"]
        assert sent[-1][1] == 1  # the row was there when the last message went out
        replay = dedup.asgi.DedupMiddleware(app, gateway=gw, kind="orders")
        sent.clear()
        async with asyncio.timeout(DEADLINE_S):
            await replay(scope, receive, send)
        assert sent[0][0]["status"] == 201 and sent[-1][0]["body"] == b"one two"
