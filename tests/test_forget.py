"""Forgetting values (Gateway.forget, forget_many, prune) against the real servers.

The contract: a forget deletes the row, clears the marker and takes the value out of
every gateway's local tier; a save racing it ends with both the row and the marker, or
neither; a ``created=False`` answer always has its row.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from redis.asyncio import Redis

from dedup import CannotForget, Gateway, Row, Unavailable
from dedup._values import digest
from dedup.store.sinks import pg_insert
from tests.servers import RedisClusterServers
from tests.test_multiprocess import read_line

ROOT = Path(__file__).resolve().parent.parent
LINE_S = 90.0


def _spawn(
    children: list[subprocess.Popen[str]], job: dict[str, Any], count: int = 1
) -> list[subprocess.Popen[str]]:
    """``count`` children of ``job``, started together, once each is READY."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.forget_child", json.dumps(job)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    children += procs
    for proc in procs:
        assert read_line(proc, LINE_S) == "READY"
    return procs


def _send(proc: subprocess.Popen[str], command: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(command) + "\n")
    proc.stdin.flush()


async def _answer(proc: subprocess.Popen[str], timeout: float = LINE_S) -> Any:
    return json.loads(await asyncio.to_thread(read_line, proc, timeout))


async def _rows(pg_url: str, values: Sequence[str]) -> set[str]:
    conn = await asyncpg.connect(pg_url)
    try:
        records = await conn.fetch(
            "SELECT value FROM dedup_items WHERE kind = 'email' AND value = ANY($1::text[])",
            list(values),
        )
    finally:
        await conn.close()
    return {r[0] for r in records}


async def _states(gw: Gateway, values: Sequence[str]) -> str:
    """One letter per value: S saved, L leased, - neither (see Claims.states)."""
    claims = gw._backends.claims
    assert claims is not None
    return await claims.states([gw._keys.key("email", digest(v)) for v in values])


def _quit(children: list[subprocess.Popen[str]]) -> None:
    for p in children:
        _send(p, {"op": "quit"})
    for p in children:
        assert p.wait(timeout=LINE_S) == 0


LAYOUTS = [{}, {"marker_layout": "keys"}, {"retention_s": 3600}]
LAYOUT_IDS = ["compact", "keys", "compact-retention"]


@pytest.mark.redis6
@pytest.mark.parametrize("options", LAYOUTS, ids=LAYOUT_IDS)
async def test_a_forgotten_value_saves_again_once(
    redis_url: str, pg_url: str, children: list[subprocess.Popen[str]], options: dict[str, Any]
) -> None:
    # Saved through A, known to the local tiers of A and of B (another process), and
    # forgotten by C: then A and B save it at once, and exactly one of them creates it.
    # The tiers learn only their own answers here (shared_learn off): with it on, B may
    # rightly answer "local" from the fleet's word that A's save just created it, and a
    # stale entry could not be told from that.
    value = "a@example.com"
    options = {**options, "shared_learn": False}
    async with (
        Gateway(redis_url, pg_url, **options) as a,
        Gateway(redis_url, pg_url, **options) as c,
    ):
        assert (await a.save("email", value)).created
        assert (await a.save("email", value)).source == "local"
        job = {"redis_url": redis_url, "database_url": pg_url, "options": options}
        (b,) = _spawn(children, job)
        _send(b, {"op": "save", "values": [value, value]})
        (_, created_first, _), _ = await _answer(b)
        assert created_first is False
        _send(b, {"op": "save", "values": [value]})
        assert (await _answer(b))[0][2] == "local"  # in B's tier
        assert await _states(c, [value]) == "S"

        assert await c.forget("email", value) is True
        assert await _rows(pg_url, [value]) == set()
        assert await _states(c, [value]) == "-"  # marker gone, no hold left
        assert await c.forget("email", value) is False  # nothing left to delete

        _send(b, {"op": "save", "values": [value]})
        mine = await a.save("email", value)
        (_, theirs, their_source) = (await _answer(b))[0]
        assert [mine.created, theirs].count(True) == 1, (mine, theirs, their_source)
        assert "local" not in (mine.source, their_source)
        assert await _rows(pg_url, [value]) == {value}
        assert await _states(c, [value]) == "S"
    _quit(children)


RACE_DELETES = 8
"""Rows a forget race test deletes under the savers before it stops them: two or three
rounds of forgets (each waits FORGET_WAIT_S), every deleted value created again by the
savers within the next round."""
RACE_CAP_S = 60.0
"""Bound of a forget race test's stream, should the deletes never come."""


async def _forget_loop(
    gw: Gateway, values: list[str], deletes: int, until: float, seed: int
) -> list[tuple[str, float, float, bool]]:
    """Forget random handfuls of ``values`` until ``deletes`` rows were deleted (or
    ``until`` passed): (value, start, end, deleted)."""
    rng = random.Random(seed)
    done: list[tuple[str, float, float, bool]] = []
    while sum(1 for f in done if f[3]) < deletes and time.monotonic() < until:
        await asyncio.sleep(rng.random() * 0.2)
        chosen = rng.sample(values, 4)
        start = time.monotonic()
        results = await gw.forget_many([("email", v) for v in chosen])
        end = time.monotonic()
        done += [(v, start, end, r) for v, r in zip(chosen, results, strict=True)]
    return done


async def _forgets_during_saves(
    redis_url: str,
    pg_url: str,
    children: list[subprocess.Popen[str]],
    options: dict[str, Any],
) -> None:
    values = [f"v{i}@example.com" for i in range(30)]
    job = {"redis_url": redis_url, "database_url": pg_url, "options": options}
    async with Gateway(redis_url, pg_url, **options) as forgetter:
        savers = _spawn(children, job, 2)
        for i, p in enumerate(savers):
            stream = {"values": values, "seconds": RACE_CAP_S, "seed": i, "keep": "decisive"}
            _send(p, {"op": "stream", **stream})
        forgets = await _forget_loop(
            forgetter, values, RACE_DELETES, time.monotonic() + RACE_CAP_S - 5, 7
        )
        for p in savers:
            _send(p, {"op": "stop"})
        # Each saver's errors, created=True answers and last save of each value: all
        # that the checks below read (see tests.forget_child).
        saves = [record for p in savers for record in await _answer(p)]
        _quit(children)
        rows = await _rows(pg_url, values)
        states = dict(zip(values, await _states(forgetter, values), strict=True))

    errors = [s for s in saves if s[3] is None]
    assert not errors, errors[:5]
    last_forget_end = {v: max((f[2] for f in forgets if f[0] == v), default=0.0) for v in values}
    for value, start, _, created, source in saves:
        if start > last_forget_end[value]:
            # Answered after every forget of the value ended: its row is there.
            assert value in rows, (value, created, source)
    for value in values:  # the two end states: row and marker, or neither
        assert (states[value] == "S") == (value in rows), (value, states[value])
    # The race happened: rows were deleted under the savers, and created again.
    assert sum(1 for f in forgets if f[3]) >= RACE_DELETES
    assert sum(1 for s in saves if s[3]) > len(values)


@pytest.mark.redis6
@pytest.mark.parametrize("options", LAYOUTS, ids=LAYOUT_IDS)
async def test_forgets_during_saves_from_two_processes(
    redis_url: str, pg_url: str, children: list[subprocess.Popen[str]], options: dict[str, Any]
) -> None:
    await _forgets_during_saves(redis_url, pg_url, children, options)


@pytest.mark.redis6
async def test_forgets_during_saves_with_shared_writes_and_a_secret(
    redis_url: str, pg_url: str, children: list[subprocess.Popen[str]]
) -> None:
    # The fleet's writer and its saved-values broadcast, signed: invalidations ride on
    # the same subscription.
    options = {"shared_writes": "on", "shared_secret": "s" * 32}
    await _forgets_during_saves(redis_url, pg_url, children, options)


@pytest.mark.redis6
@pytest.mark.parametrize("layout", ["compact", "keys"])
async def test_forgets_during_saves_on_a_cluster(
    cluster_servers: RedisClusterServers,
    pg_url: str,
    children: list[subprocess.Popen[str]],
    layout: str,
) -> None:
    options = {"cluster_shards": 16, "marker_layout": layout}
    await _forgets_during_saves(cluster_servers.url, pg_url, children, options)


@pytest.mark.redis6
async def test_prune_during_saves_loses_nothing_saved_after_its_cutoff(
    redis_url: str, pg_url: str, children: list[subprocess.Popen[str]]
) -> None:
    old = [f"old{i}@example.com" for i in range(3000)]
    new = [f"new{i}@example.com" for i in range(200)]
    async with Gateway(redis_url, pg_url) as gw:
        await gw.save_many([("email", v) for v in old])
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute("UPDATE dedup_items SET created_at = now() - interval '40 days'")
        finally:
            await conn.close()
        (saver,) = _spawn(children, {"redis_url": redis_url, "database_url": pg_url})
        touched = new + old[:100]  # old values saved again while the prune runs
        _send(saver, {"op": "stream", "values": touched, "seconds": 3.0, "concurrency": 8})
        seen: list[tuple[int, int]] = []
        started = time.monotonic()
        pruned = await gw.prune(
            "email", 30 * 86400, batch_size=250, progress=lambda d, t: seen.append((d, t))
        )
        ended = time.monotonic()
        saves = await _answer(saver)
        _quit(children)
        rows = await _rows(pg_url, old + new)
        states = dict(zip(old + new, await _states(gw, old + new), strict=True))
        assert await gw.prune("email", 30 * 86400) == 0  # run again: nothing left

    assert pruned == len(old)  # every old row, each once; no new row
    assert seen and seen[-1] == (len(old), len(old))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert all(s[3] is not None for s in saves)
    saved_new = {s[0] for s in saves if s[0].startswith("new")}
    assert saved_new and saved_new <= rows  # saved after the cutoff: never deleted
    untouched = set(old[100:])
    assert not rows & untouched
    for value, start, _, _, _ in saves:
        if start > ended:
            assert value in rows
    for value in old + new:
        assert (states[value] == "S") == (value in rows), value
    assert started < ended


async def test_a_forget_waits_for_a_save_in_flight(redis_url: str, pg_url: str) -> None:
    # A save whose write is under way holds the value's lease: the forget waits for the
    # write to end, then deletes the row it wrote (never the other way round).
    pool = await asyncpg.create_pool(pg_url, min_size=1, max_size=2)
    writing = asyncio.Event()

    async def slow(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        writing.set()
        await asyncio.sleep(0.5)
        return await pg_insert(pool, rows)

    try:
        async with Gateway(redis_url, sink=slow) as saver, Gateway(redis_url, pg_url) as c:
            save = asyncio.create_task(saver.save("email", "w@example.com"))
            await asyncio.wait_for(writing.wait(), 10)
            assert await c.forget("email", "w@example.com") is True
            assert save.done() and (await save).created
            assert await _rows(pg_url, ["w@example.com"]) == set()
            assert await _states(c, ["w@example.com"]) == "-"
            # The saver's tier must not answer it any more: it saves it again, a new row.
            again = await saver.save("email", "w@example.com")
            assert again.created and again.source == "write"
    finally:
        await pool.close()


async def test_modes_that_cannot_forget_say_so(redis_url: str, pg_url: str) -> None:
    async def sink(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        return [(r.kind, r.digest) for r in rows]

    async with Gateway(redis_url, pg_url, approximate_values=10_000) as approx:
        await approx.save("email", "b@example.com")
        with pytest.raises(CannotForget, match="Bloom"):
            await approx.forget("email", "b@example.com")
        assert await _rows(pg_url, ["b@example.com"]) == {"b@example.com"}
    async with Gateway(redis_url, sink=sink) as custom:
        with pytest.raises(CannotForget, match="custom sink"):
            await custom.forget_many([("email", "b@example.com")])
        with pytest.raises(CannotForget):
            await custom.prune("email", 60)


async def test_forget_needs_redis(pg_url: str, tmp_path: Path) -> None:
    # Degraded (Redis unreachable): no gateway's tier can be told, so nothing is deleted.
    down = f"unix://{tmp_path}/nothing.sock"
    async with Gateway(down, pg_url) as gw:
        assert gw.degraded
        assert (await gw.save("email", "c@example.com")).created
        with pytest.raises(Unavailable) as info:
            await gw.forget("email", "c@example.com")
        assert info.value.component == "redis"
        assert await _rows(pg_url, ["c@example.com"]) == {"c@example.com"}
        # Cut off from the invalidation channel, the tier answers nothing.
        assert (await gw.save("email", "c@example.com")).source == "db"


async def test_a_gateway_that_loses_its_channel_drops_its_tier(redis_url: str, pg_url: str) -> None:
    async with Gateway(redis_url, pg_url, shared_writes="off") as gw:
        await gw.save("email", "d@example.com")
        assert (await gw.save("email", "d@example.com")).source == "local"
        admin = Redis.from_url(redis_url)
        try:
            assert await admin.client_kill_filter(_type="pubsub") >= 1
        finally:
            await admin.aclose()
        deadline = time.monotonic() + 10
        while gw._local.answering() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(gw._local) == 0  # dropped
        # Heard again: it learns and answers locally once more.
        deadline = time.monotonic() + 10
        while not gw._local.answering() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert gw._local.answering()
        assert (await gw.save("email", "d@example.com")).source == "redis"
        assert (await gw.save("email", "d@example.com")).source == "local"


async def test_forged_invalidations_are_ignored_with_a_secret(redis_url: str, pg_url: str) -> None:
    secret = "k" * 32
    async with Gateway(redis_url, pg_url, shared_secret=secret, shared_writes="off") as gw:
        await gw.save("email", "e@example.com")
        engine = gw._engine
        assert engine is not None
        invalidations = engine.invalidations
        forged = (
            b"|" + json.dumps([1, "forgotten", "email", digest("e@example.com").hex()]).encode()
        )
        admin = Redis.from_url(redis_url)
        try:
            await admin.publish(invalidations.channel, forged)
            await admin.publish(invalidations.channel, b"junk")
        finally:
            await admin.aclose()
        deadline = time.monotonic() + 10
        while invalidations.bad_messages < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert invalidations.bad_messages == 2
        assert (await gw.save("email", "e@example.com")).source == "local"


async def test_sync_gateway_forgets_and_prunes(redis_url: str, pg_url: str) -> None:
    from dedup import SyncGateway

    def run() -> tuple[bool, list[bool], int]:
        with SyncGateway(redis_url, pg_url) as gw:
            gw.save_many([("email", v) for v in ("f1", "f2", "f3")])
            one = gw.forget("email", "f1")
            many = gw.forget_many([("email", "f2"), ("email", "nope")])
            return one, many, gw.prune("email", 3600)

    one, many, pruned = await asyncio.to_thread(run)
    assert (one, many, pruned) == (True, [True, False], 0)
    assert await _rows(pg_url, ["f1", "f2", "f3"]) == {"f3"}


async def test_the_middlewares_forget_a_key_and_its_response(redis_url: str, pg_url: str) -> None:
    # aiohttp (served) and WSGI (called as a server would): a replayed key is forgotten
    # with its stored response, and the next request with it runs the handler again.
    import aiohttp
    from aiohttp import web

    import dedup.aiohttp
    from dedup import SyncGateway
    from dedup.wsgi import DedupMiddleware

    runs: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        runs.append("aiohttp")
        return web.Response(status=201, text=f"run {len(runs)}")

    async with Gateway(redis_url, pg_url) as gw:
        mw = dedup.aiohttp.middleware(gw, kind="orders")
        app = web.Application(middlewares=[mw])
        app.router.add_post("/orders", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/orders"
        try:
            async with aiohttp.ClientSession() as http:
                bodies = []
                for _ in range(2):
                    async with http.post(url, headers={"Idempotency-Key": "k1"}) as r:
                        bodies.append(
                            (r.status, await r.text(), r.headers.get("Idempotent-Replayed"))
                        )
                assert bodies == [(201, "run 1", None), (201, "run 1", "true")]
                assert await mw.forget("k1") is True
                assert await mw.forget("k1") is False
                async with http.post(url, headers={"Idempotency-Key": "k1"}) as r:
                    assert (r.status, await r.text()) == (201, "run 2")
                    assert "Idempotent-Replayed" not in r.headers
        finally:
            await runner.cleanup()

    def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        runs.append("wsgi")
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [f"run {len(runs)}".encode()]

    def call(middleware: DedupMiddleware) -> tuple[str, bytes]:
        import io

        status: list[str] = []
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/orders",
            "QUERY_STRING": "",
            "CONTENT_LENGTH": "0",
            "HTTP_IDEMPOTENCY_KEY": "k2",
            "wsgi.input": io.BytesIO(b""),
        }
        body = b"".join(middleware(environ, lambda s, h, e=None: status.append(s)))  # type: ignore[arg-type]
        return status[0], body

    def run_wsgi() -> tuple[tuple[str, bytes], tuple[str, bytes], bool, tuple[str, bytes]]:
        with SyncGateway(redis_url, pg_url) as sync:
            middleware = DedupMiddleware(wsgi_app, gateway=sync, kind="orders", scope=None)
            first, again = call(middleware), call(middleware)
            forgotten = middleware.forget("k2")
            return first, again, forgotten, call(middleware)

    first, again, forgotten, after = await asyncio.to_thread(run_wsgi)
    assert first == again and forgotten is True
    assert after != first and after[1].startswith(b"run ")
    assert runs.count("wsgi") == 2


@pytest.mark.redis6
@pytest.mark.parametrize("options", LAYOUTS, ids=LAYOUT_IDS)
async def test_a_commit_leaves_a_forgets_hold_alone(
    redis_url: str, pg_url: str, options: dict[str, Any]
) -> None:
    # A writer whose lease ran out commits while a forget holds the value: the commit
    # sets no marker and gives the hold back (the forget deletes the row next).
    async with Gateway(redis_url, pg_url, **options) as gw:
        claims = gw._backends.claims
        assert claims is not None
        key = gw._keys.key("email", digest("held@example.com"))
        assert await claims.claim([key]) == "W"  # the writer's lease...
        assert await claims.forget([key], "Fsometoken") == "B"  # ...the forget waits
        admin = Redis.from_url(redis_url)
        try:
            await admin.delete(key)  # the writer's lease ran out
            assert await claims.forget([key], "Fsometoken") == "W"
            assert await claims.commit([key]) == 0  # the late writer's commit
            assert await admin.get(key) == b"Fsometoken"
            assert 0 < await admin.pttl(key) <= claims.lease_ms
        finally:
            await admin.aclose()
        assert await _states(gw, ["held@example.com"]) == "L"  # held, no marker
        assert await claims.forget_release([key], "Fsometoken") == "1"
        assert await _states(gw, ["held@example.com"]) == "-"
