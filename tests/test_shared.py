"""Shared writes: one elected writer for the fleet, and what happens when it fails.

Each scenario checks the contract from the table and the callers' answers
(:func:`tests.test_faults.check_contract`): nothing acknowledged is missing, no
value got created=True twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import asyncpg
import orjson
import pytest
from redis.asyncio import Redis

from dedup import ConfigError, Gateway, Row, SaveResult
from dedup._claims.keys import KeySpace
from dedup._engine.flights import Flight
from dedup._engine.shared import _POP, _Queued
from dedup._engine.shared_wire import BadMessage, Wire
from dedup._values import Limits, digest
from dedup.options import GatewayOptions
from dedup.service.settings import load_settings
from dedup.store import default_identity, open_sink, pg_insert
from dedup.store.migrate import upgrade_async
from tests.servers import PostgresCluster, RedisServer
from tests.slow_proxy import SlowProxy
from tests.test_faults import WAIT_S, Key, Ledger, check_contract, loaded, table, until
from tests.test_processes import Child

pytestmark = pytest.mark.slow

SHARED: dict[str, Any] = {"shared_writes": "on", "lease_ms": 800, "wait_timeout_s": WAIT_S}
# SHARED's 800 ms lease leaves a write budget of 0.48 s; a row is queued only with more
# than that and 0.2 s left before its caller's deadline. A 0.5 s wait leaves less: such a
# gateway's claimant writes its winners itself (SHARED's 30 s wait leaves much more).
NEAR_DEADLINE: dict[str, Any] = {**SHARED, "wait_timeout_s": 0.5}


def _shared(gw: Gateway) -> Any:
    engine = gw._engine
    assert engine is not None and engine.shared is not None
    return engine.shared


async def test_one_writer_writes_for_every_gateway(
    redis_url: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger()
    async with (
        Gateway(redis_url, pg_url, **SHARED) as a,
        Gateway(redis_url, pg_url, **SHARED) as b,
        Gateway(redis_url, pg_url, **SHARED) as c,
    ):
        gateways = [a, b, c]
        await until("every gateway to listen", lambda: all(_shared(g).active for g in gateways))
        # Round robin, so that every gateway wins values of its own (racing, the first
        # gateway's claims win nearly all of them; the races are the tests below).
        async with loaded(gateways, ledger, both=False) as load:
            await load.grows_by(3000, "saves through the shared writer")
        stats = [g.stats() for g in gateways]
    writers = [s for s in stats if s.shared_statements]
    await check_contract(
        capsys, "shared writes, 3 gateways", pg_url, ledger,
        queued=sum(s.shared_rows_queued for s in stats),
        shared_statements=sum(s.shared_statements for s in stats),
        statements=sum(s.db_statements for s in stats),
    )  # fmt: skip
    assert sum(s.shared_rows_queued for s in stats) > 0
    assert writers, "no gateway wrote for the fleet"
    # Every winner's row went to the fleet's writer: through the one queue (each gateway
    # that did not write queued some), or, the writer's own, straight into its statements.
    assert all(s.shared_rows_queued > 0 for s in stats if not s.shared_statements)
    assert all(s.shared_rows_queued + s.shared_rows_own > 0 for s in stats)


async def test_auto_shares_only_while_several_gateways_live(redis_url: str, pg_url: str) -> None:
    ns: dict[str, Any] = {"namespace": "auto-mode"}
    async with Gateway(redis_url, pg_url, **ns) as alone:
        await asyncio.sleep(1.5)  # a heartbeat or two: a fleet of one
        assert not _shared(alone).active
        assert (await alone.save("auto", "one")).created
        assert alone.stats().shared_rows_queued == 0  # written here, no extra hop
        async with Gateway(redis_url, pg_url, **ns) as second:
            await until("both to see a fleet of two", lambda: _shared(alone).active)
            await until("the second to see it too", lambda: _shared(second).active)
            results = await asyncio.gather(*(alone.save("auto", f"v{i}") for i in range(50)))
            assert all(r.created for r in results)
            assert alone.stats().shared_rows_queued > 0
        # The second one left: the first goes back to writing its own winners.
        await until("a fleet of one again", lambda: not _shared(alone).active, 10)


async def test_writer_handover_keeps_every_created_true(
    redis_url: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Writers leave cleanly, one after another, while two claimants race on every value;
    the last leaves none. Rows queued for an old term are taken back by their claimants
    or written by the next writer, never both: each value's one ``created=True`` reaches
    its caller (a row written twice would answer both callers ``created=False``)."""
    ledger = Ledger()
    writers: list[Gateway] = []
    async with (
        Gateway(redis_url, pg_url, **SHARED) as b,
        Gateway(redis_url, pg_url, **SHARED) as c,
    ):
        for g in (b, c):
            _shared(g)._rest_until = float("inf")  # claimants only: they never stand
        try:
            async with loaded([b, c], ledger, both=True) as load:
                for turn in range(4):
                    w = Gateway(redis_url, pg_url, **SHARED)
                    await w.open()
                    writers.append(w)
                    if turn:
                        await load.grows_by(500, f"saves before handover {turn}")
                        await writers[turn - 1].aclose()
                    await until(f"writer {turn}", partial(_is_writer, w))
                    await load.grows_by(1000, f"saves under writer {turn}")
                await writers[-1].aclose()  # no writer now: claimants take their rows back
                await load.grows_by(500, "saves with no writer")
        finally:
            for w in writers:
                await w.aclose()
        stats = [g.stats() for g in (b, c)]
    rows = await check_contract(
        capsys, "writer handovers", pg_url, ledger,
        queued=sum(s.shared_rows_queued for s in stats),
        taken_back=sum(s.shared_rows_returned for s in stats),
    )  # fmt: skip
    assert all(s.shared_rows_queued > 0 for s in stats)
    assert not ledger.errors
    missing = [k for k in rows if ledger.acks.get(k, []).count(True) != 1]
    assert not missing, f"{len(missing)} of {len(rows)} rows had no created=True: {missing[:5]}"


def _is_writer(g: Gateway) -> bool:
    return bool(_shared(g).writer)


def _hold_child(spawn: Callable[[dict[str, Any]], Child], redis_url: str, pg_url: str) -> Child:
    """A gateway whose sink hangs for good: as the fleet's writer it pops rows and never
    writes them (a hung writer); its own claim batch is what made it the writer."""
    child = spawn(
        {
            "mode": "hold",
            "redis_url": redis_url,
            "identity": default_identity(pg_url),
            "items": [["held", f"h{i}"] for i in range(5)],
            "options": SHARED,
        }
    )
    assert child.read_line().startswith("HOLDING")
    return child


async def test_paused_writer_is_taken_over(
    redis_url: str,
    pg_url: str,
    spawn: Callable[[dict[str, Any]], Child],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
) -> None:
    values = [f"p{i}" for i in range(600)]
    out = tmp_path / "paused.jsonl"
    writer = spawn(
        {
            "mode": "save",
            "redis_url": redis_url,
            "database_url": pg_url,
            "items": [["email", v] for v in values],
            "concurrency": 8,
            "out": str(out),
            "name": "paused",
            "options": SHARED,
        }
    )
    assert writer.read_line() == "READY"  # it opened first: it stands for writer first
    ledger = Ledger()
    async with Gateway(redis_url, pg_url, **SHARED) as gw:
        await until("listening", lambda: _shared(gw).active)
        first = [("email", v) for v in values[:200]]
        for key, r in zip(first, await gw.save_many(first), strict=True):
            ledger.record(key, r)
        assert gw.stats().shared_statements == 0  # the child wrote them
        os.kill(writer.pid, signal.SIGSTOP)  # paused, past its lease
        try:
            rest = [("email", v) for v in values[200:]]
            for key, r in zip(rest, await gw.save_many(rest), strict=True):
                ledger.record(key, r)
            await until("the writer lease to pass here", lambda: _shared(gw).writer)
        finally:
            os.kill(writer.pid, signal.SIGCONT)
        writer.send("go\n")  # the woken writer now saves every value again
        while (line := writer.read_line()) != "DONE":
            pass
    for line in out.read_text().splitlines():
        ledger.record_line(json.loads(line))
    rows = await check_contract(capsys, "shared writer SIGSTOPped past its lease", pg_url, ledger)
    assert {v for _, v in rows} >= set(values)


async def test_redis_restarted_under_shared_writes(
    fresh_redis: RedisServer, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger()
    options: dict[str, Any] = {**SHARED, "redis_timeout_s": 0.5, "breaker_cooldown_s": 0.3}
    async with (
        Gateway(fresh_redis.url, pg_url, **options) as a,
        Gateway(fresh_redis.url, pg_url, **options) as b,
    ):
        await until("listening", lambda: _shared(a).active and _shared(b).active)
        async with loaded([a, b], ledger, both=True) as load:
            await load.grows_by(500, "saves before the fault")
            fresh_redis.kill()  # the queue, the leases and the writer lease are gone
            await until("degraded", lambda: a.degraded and b.degraded)
            await load.grows_by(200, "saves while Redis is down")
            await asyncio.to_thread(fresh_redis.restart)
            await until("normal again", lambda: not a.degraded and not b.degraded)
            await until("listening again", lambda: _shared(a).active and _shared(b).active)
            await load.grows_by(500, "saves after the restart")
    await check_contract(capsys, "Redis restarted under shared writes", pg_url, ledger)
    assert len(await table(pg_url)) >= len([k for k, f in ledger.acks.items() if f])


async def test_rows_queued_when_redis_dies_are_written_here_at_once(
    fresh_redis: RedisServer, pg_url: str
) -> None:
    """Redis killed while a row waits for the writer: no word can come, so once the
    claimant's circuit opens it writes the row itself, through the database alone, long
    before its caller's deadline (a minute here), rather than waiting for that deadline."""
    options: dict[str, Any] = {
        **SHARED, "lease_ms": 3000, "wait_timeout_s": 60, "redis_timeout_s": 0.5,
        "breaker_failures": 1, "breaker_cooldown_s": 0.3,
    }  # fmt: skip
    # The writer's statements sleep 30 s first: the row stays queued or held, unwritten.
    async with (
        _slow_writer(fresh_redis.url, pg_url, 30.0, options),
        Gateway(fresh_redis.url, pg_url, **options) as claimant,
    ):
        shared = _shared(claimant)
        await until("listening", lambda: shared.active)
        saving = asyncio.ensure_future(claimant.save("email", "stranded@example.com"))
        await until("the row to be queued", lambda: bool(shared._pending))
        fresh_redis.kill()
        result = await asyncio.wait_for(saving, 15)  # its deadline is a minute away
        stats = claimant.stats()
    assert result == SaveResult(True, "write")
    assert stats.shared_rows_returned == 1 and stats.degraded_answers == 1
    assert await table(pg_url) == {("email", "stranded@example.com")}


# ------------------------------------------------------------------ rows reach their own database


async def _second_database(pg_cluster: PostgresCluster, pg_url: str) -> str:
    """A second migrated database on the session's cluster (dropped with the test's own)."""
    name = urlsplit(pg_url).path.lstrip("/") + "_b"
    url = pg_cluster.create_database(name)
    await upgrade_async(url)
    return url


def _sqlite_rows(url: str) -> set[Key]:
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as conn:
        return {(k, v) for k, v in conn.execute("SELECT kind, value FROM dedup_items")}


async def _rows(url: str) -> set[Key]:
    return _sqlite_rows(url) if url.startswith("sqlite") else await table(url)


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
async def test_services_on_one_redis_write_only_their_own_databases(
    redis_url: str,
    pg_url: str,
    pg_cluster: PostgresCluster,
    tmp_path: Path,
    database: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two services, two gateways each, their own database each, one Redis and the
    default namespace and mode: each service's gateways share a writer, and every
    acknowledged row is in its service's database, none in the other's."""
    if database == "postgresql":
        urls = [pg_url, await _second_database(pg_cluster, pg_url)]
    else:
        urls = [f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"]
    options: dict[str, Any] = {"migrate": True, "wait_timeout_s": WAIT_S, "lease_ms": 2000}
    ledgers = [Ledger(), Ledger()]
    async with contextlib.AsyncExitStack() as stack:
        services = [
            [await stack.enter_async_context(Gateway(redis_url, url, **options)) for _ in "12"]
            for url in urls
        ]
        everyone = [gw for service in services for gw in service]
        await until("each service to see a fleet of two", lambda: all(
            _shared(g).active for g in everyone))  # fmt: skip
        await until("a writer per service", lambda: all(
            any(_shared(g).writer for g in service) for service in services))  # fmt: skip

        async def run(n: int) -> None:
            keys = [("email", f"svc{n}-{i}@example.com") for i in range(600)]
            for start in range(0, len(keys), 50):
                chunk = keys[start : start + 50]
                # Both gateways of the service save every value: they race for it.
                for gw in services[n]:
                    ledgers[n].record_all(chunk, await gw.save_many(chunk))

        await asyncio.gather(run(0), run(1))
        stats = [[g.stats() for g in service] for service in services]
    for n, url in enumerate(urls):
        rows, acked = await _rows(url), {k for k, f in ledgers[n].acks.items() if f}
        other = {k for k, f in ledgers[1 - n].acks.items() if f}
        with capsys.disabled():
            queued = sum(s.shared_rows_queued for s in stats[n])
            print(f"\n[shared] {database} service {n}: acknowledged={len(acked)} rows={len(rows)} "
                  f"queued={queued} other's rows here={len(rows & other)}", flush=True)  # fmt: skip
        assert acked <= rows, (
            f"acknowledged but not in its own database: {sorted(acked - rows)[:3]}"
        )
        assert not rows & other, f"another service's rows: {sorted(rows & other)[:3]}"
        assert all(sum(flags) == 1 for flags in ledgers[n].acks.values())
        assert sum(s.shared_rows_queued for s in stats[n]) > 0  # they did share a writer
        assert sum(s.shared_statements for s in stats[n]) > 0


async def test_markers_are_still_shared_across_sinks(
    redis_url: str, pg_url: str, pg_cluster: PostgresCluster
) -> None:
    """Gateways of different sinks on one namespace share the markers as before: a
    value saved through one is answered "saved" by the other, which writes no row."""
    other_url = await _second_database(pg_cluster, pg_url)
    async with Gateway(redis_url, pg_url) as a, Gateway(redis_url, other_url) as b:
        assert (await a.save("email", "shared@example.com")).created
        assert await b.save("email", "shared@example.com") == SaveResult(False, "redis")
    assert await table(other_url) == set()


def test_sink_identity_names_the_database_without_its_password() -> None:
    here = socket.gethostname()
    a = default_identity("postgresql://app:s3cret@db.internal/app")
    assert "s3cret" not in a
    assert a == default_identity("postgres://app:other@db.internal:5432/app")
    assert a != default_identity("postgresql://app@db.internal/app2")
    assert a != default_identity("postgresql://app@db2.internal/app")
    assert a != default_identity("postgresql://other@db.internal/app")
    # A database on this machine is another database on another machine.
    assert here in default_identity("postgresql://app@localhost/app")
    assert here in default_identity("postgresql://app@/app?host=/run/postgresql")
    assert here in default_identity("sqlite:///tmp/x.db")
    assert "pw" not in default_identity("postgresql://app@db/app?password=pw&sslmode=require")
    assert default_identity("sqlite:///tmp/./x.db") == default_identity("sqlite:///tmp/x.db")


def test_sink_identity_reads_what_the_url_leaves_out_where_asyncpg_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One URL that names no host, port, user or database reaches the database the PG*
    variables name (asyncpg reads them): two processes whose variables differ must not
    share a writer, so their identities differ; a part the URL names wins over them."""
    for name in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGSERVICE"):
        monkeypatch.delenv(name, raising=False)
    bare = "postgresql:///"
    plain = default_identity(bare)
    seen = {plain}
    for name, value in [
        ("PGHOST", "db1.internal"),
        ("PGPORT", "5433"),
        ("PGUSER", "svc"),
        ("PGDATABASE", "orders"),
        ("PGSERVICE", "billing"),
    ]:
        monkeypatch.setenv(name, value)
        identity = default_identity(bare)
        assert identity not in seen, (name, identity)
        seen.add(identity)
        monkeypatch.delenv(name)
    monkeypatch.setenv("PGHOST", "db1.internal")
    one = default_identity(bare)
    monkeypatch.setenv("PGHOST", "db2.internal")
    assert default_identity(bare) != one
    # A URL that names every part reaches the same database whatever the variables say.
    full = "postgresql://app@db.internal:5432/app"
    named = default_identity(full)
    for name, value in [("PGPORT", "5433"), ("PGUSER", "svc"), ("PGDATABASE", "orders")]:
        monkeypatch.setenv(name, value)
    assert default_identity(full) == named
    # A host taken from PGHOST on this machine (a socket folder) is this machine's.
    monkeypatch.setenv("PGHOST", "/run/postgresql")
    assert socket.gethostname() in default_identity(bare)


async def test_a_sink_without_identity_writes_only_its_own_rows(redis_url: str) -> None:
    async def sink(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        return [(r.kind, r.digest) for r in rows]

    async with Gateway(redis_url, sink=sink) as gw:  # "auto": no sharing at all
        assert gw._engine is not None and gw._engine.shared is None
        assert (await gw.save("anon", "v")).created
    with pytest.raises(ConfigError, match="identity"):
        async with Gateway(redis_url, sink=sink, shared_writes="on"):
            pass


def test_shared_secret_is_checked_and_never_shown() -> None:
    with pytest.raises(ConfigError, match="at least 16") as caught:
        Gateway(shared_secret="short-secret")
    assert "short-secret" not in str(caught.value)
    secret = "a-long-enough-test-secret"
    assert secret not in repr(GatewayOptions(shared_secret=secret))
    settings = load_settings(config_path=None, environ={"DEDUP_SHARED_SECRET": secret}, flags={})
    assert secret not in repr(settings)
    assert settings.options().shared_secret == secret
    # Key names (and so markers) are keyed by the secret: a guess needs the secret.
    plain, keyed = KeySpace("dedup"), KeySpace("dedup", secret=secret.encode())
    d = digest("guessed@example.com")
    assert plain.key("email", d) != keyed.key("email", d)
    assert keyed.key("email", d) == KeySpace("dedup", secret=secret.encode()).key("email", d)
    assert d not in keyed.key("email", d)


# ------------------------------------------------------------------ a writer that cannot write


def _proxied(pg_url: str, proxy: SlowProxy) -> str:
    parts = urlsplit(pg_url)
    return parts._replace(netloc=parts.netloc.replace(f":{parts.port}", f":{proxy.port}")).geturl()


async def test_writer_cut_off_from_its_database_steps_down(
    redis_url: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The elected writer reaches the database through a TCP proxy that is cut; the other
    gateway's path works: it goes on acknowledging new values as created=True within two
    leases of the cut, and nothing is lost or created twice."""
    lease_s = 2.0
    options: dict[str, Any] = {**SHARED, "lease_ms": int(lease_s * 1000)}
    parts = urlsplit(pg_url)
    assert parts.hostname is not None and parts.port is not None
    proxy = await SlowProxy(parts.hostname, parts.port).start()
    # The writer's own sink goes through the proxy to the same database, and says so
    # (its URL alone names another port, so another database as far as dedup can tell).
    cut_off = open_sink(_proxied(pg_url, proxy), pool_size=4, statement_timeout_ms=1000)
    cut_off.identity = default_identity(pg_url)
    ledger = Ledger()
    try:
        await cut_off.open()
        async with Gateway(redis_url, sink=cut_off, **options) as writer:
            await until("the first gateway to write for the fleet", lambda: _shared(writer).writer)
            async with Gateway(redis_url, pg_url, **options) as other:
                await until("both to listen", lambda: _shared(other).active)
                before = [("email", f"pre{i}") for i in range(100)]
                ledger.record_all(before, await other.save_many(before))
                assert other.stats().shared_rows_queued > 0  # written by the writer
                assert not _shared(other).writer
                await proxy.aclose()  # the cut: connections dropped, new ones refused
                cut = time.monotonic()
                first = [("email", f"cut{i}") for i in range(100)]
                ledger.record_all(first, await other.save_many(first))
                took = time.monotonic() - cut
                assert all(ledger.acks[k] == [True] for k in first)
                assert took < 2 * lease_s, f"new values acknowledged {took:.2f} s after the cut"
                async with loaded([other, writer], ledger, both=False) as load:
                    await load.grows_by(1000, "saves after the cut")
                await until("the cut-off writer to give up the role",
                            lambda: not _shared(writer).writer)  # fmt: skip
                stats = [writer.stats(), other.stats()]
    finally:
        await cut_off.aclose()
        await proxy.aclose()
    rows = await check_contract(
        capsys, "shared writer cut off from its database", pg_url, ledger,
        seconds_to_first_ack=round(took, 2), writer_db_errors=stats[0].db_errors,
        rows_taken_back=stats[1].shared_rows_returned,
    )  # fmt: skip
    assert {k for k, _ in ledger.acks.items()} <= rows
    assert stats[0].db_errors > 0
    # The cut-off gateway's own callers failed only because its own database did.
    assert set(ledger.errors) <= {"Unavailable"}


async def test_sink_that_hangs_and_ignores_cancellation_cannot_hold_the_fleet(
    redis_url: str,
    pg_url: str,
    spawn: Callable[[dict[str, Any]], Child],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The writer's sink never returns, even when cancelled: its statement times out, it
    hands the rows back and gives up the role, and never stands again while that call
    runs; the other gateway writes its own rows, then the fleet's."""
    holder = _hold_child(spawn, redis_url, pg_url)
    ledger = Ledger()
    async with Gateway(redis_url, pg_url, **SHARED) as gw:
        await until("listening", lambda: _shared(gw).active)
        values = [("email", f"hung{i}") for i in range(200)]
        ledger.record_all(values, await gw.save_many(values))
        assert all(flags == [True] for flags in ledger.acks.values())
        # The hung one gave up, though alive: this gateway takes over.
        await until("the writer lease to pass here", lambda: _shared(gw).writer)
        assert holder.proc.poll() is None
        more = [("email", f"after{i}") for i in range(200)]
        ledger.record_all(more, await gw.save_many(more))
        stats = gw.stats()
    holder.kill()
    await check_contract(
        capsys, "shared writer's sink hung", pg_url, ledger,
        shared_statements=stats.shared_statements, taken_back=stats.shared_rows_returned,
    )  # fmt: skip
    assert stats.shared_statements > 0
    assert len(ledger.acks) == 400 and all(f == [True] for f in ledger.acks.values())


# ------------------------------------------------------------------ checked messages

SECRET = "a-test-shared-secret-of-32-chars"


def _slow_sink(pg_url: str, sleep_s: float) -> Any:
    """A sink on ``pg_url``'s dedup_items whose every statement first sleeps ``sleep_s``."""
    pool: list[asyncpg.Pool] = []
    opening = asyncio.Lock()

    async def write(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        async with opening:  # one pool, however many statements come first
            if not pool:
                pool.append(await asyncpg.create_pool(pg_url, min_size=1, max_size=4))
        await asyncio.sleep(sleep_s)
        async with pool[0].acquire() as conn:
            return await pg_insert(conn, rows)

    async def aclose() -> None:
        if pool:
            await pool[0].close()

    write.identity = default_identity(pg_url)  # type: ignore[attr-defined]
    write.aclose = aclose  # type: ignore[attr-defined]
    return write


@contextlib.asynccontextmanager
async def _slow_writer(
    redis_url: str, pg_url: str, sleep_s: float, options: dict[str, Any]
) -> AsyncIterator[Gateway]:
    """A gateway whose statements first sleep ``sleep_s`` (:func:`_slow_sink`), yielded
    once it holds the writer lease; closed, then its sink, on exit."""
    slow = _slow_sink(pg_url, sleep_s)
    try:
        writer = Gateway(redis_url, sink=slow, **options)
        await writer.open()
        try:
            await until("a writer", partial(_is_writer, writer))
            yield writer
        finally:
            await writer.aclose()
    finally:
        await slow.aclose()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
async def test_malformed_and_forged_rows_are_skipped(
    redis_url: str, pg_url: str, secret: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Junk pushed onto the queue ahead of real rows: each unusable item is counted and
    skipped, the real rows of the same pop are written, and no junk reaches the table.
    A well-formed row nobody claimed (no lease) is never written; with a secret, a row
    signed with another key is never even read."""
    options: dict[str, Any] = {**SHARED, "shared_secret": secret}
    client = Redis.from_url(redis_url)
    ledger = Ledger()
    try:
        async with Gateway(redis_url, pg_url, **options) as a:
            await until("a writer", lambda: _shared(a).writer)
            async with Gateway(redis_url, pg_url, **options) as b:
                await until("listening", lambda: _shared(b).active)
                shared = _shared(b)
                wire = shared._wire
                forger = Wire(sink=wire.sink, secret=b"another-secret-of-enough-length",
                              keys=KeySpace("dedup"), limits=Limits(max_value_bytes=100,
                              max_payload_bytes=100))  # fmt: skip
                keys = KeySpace(
                    "dedup", secret=options["shared_secret"].encode() if secret else b""
                )
                key = keys.key("email", digest("forged@example.com"))
                gw = shared.gateway_id
                junk = [
                    b"not json at all",
                    b"|[1]",
                    b'|{"a": 1}',
                    b"|" + orjson.dumps([2, wire.sink, gw, 1, "Lx", key.hex(), "email", "v", None]),
                    b"|"
                    + orjson.dumps([1, "another-sink", gw, 1, "Lx", key.hex(), "e", "v", None]),
                    wire.row(gw, 1, "Lx", key, "email\n", "forged@example.com", None),  # bad kind
                    wire.row(gw, 2, "Lx", key, "email", "other@example.com", None),  # wrong key
                    wire.row(gw, 3, "Lx", key, "email", "forged@example.com", "{not json"),
                    # Well-formed and signed when the gateways sign, but nobody's claim: no
                    # lease holds its token, so it is not written.
                    wire.row(gw, 4, "Lnobody", key, "email", "forged@example.com", None),
                    # Signed with another key (or, unsigned gateways, a stray signature).
                    forger.row(gw, 5, "Lx", key, "email", "forged@example.com", None),
                ]
                await client.rpush(shared._queue_key, *junk)
                values = [("email", f"real{i}@example.com") for i in range(300)]
                for start in range(0, 300, 100):
                    chunk = values[start : start + 100]
                    ledger.record_all(chunk, await b.save_many(chunk))
                await until("the junk to be read", lambda: a.stats().shared_bad_messages >= 8)
                stats = [a.stats(), b.stats()]
    finally:
        await client.aclose()
    rows = await check_contract(
        capsys, f"junk on the queue ({'signed' if secret else 'unsigned'})", pg_url, ledger,
        bad_messages=stats[0].shared_bad_messages,
    )  # fmt: skip
    assert all(flags == [True] for flags in ledger.acks.values())
    assert ("email", "forged@example.com") not in rows
    assert stats[1].shared_rows_queued > 0  # the real rows did go through the queue
    # 8 malformed (the last two are read as good rows when unsigned: the one with no
    # lease is then handed back to a gateway that never claimed it).
    assert stats[0].shared_bad_messages >= (9 if secret else 8)


async def test_a_pop_gives_back_the_holds_of_rows_it_cannot_use(
    redis_url: str, pg_url: str
) -> None:
    """The pop script holds the lease a queued row's prefix names before the writer reads
    the row. A forged prefix naming a real queued lease, with a message that is not that
    row's, gets its hold given back (the lease is queued again, for its claimant); a
    prefix naming a key outside the namespace or a key of another type is never held,
    and breaks nothing."""
    client = Redis.from_url(redis_url)
    try:
        async with Gateway(redis_url, pg_url, **SHARED) as a:
            await until("a writer", lambda: _shared(a).writer)
            shared = _shared(a)
            wire, keys = shared._wire, KeySpace("dedup")
            queued_key = keys.key("email", digest("queued@example.com"))
            await client.set(queued_key, "Lclaimant#7", px=60_000)  # a row's queued lease
            await client.set(b"elsewhere:key", "Lx#1")  # another application's key
            bucket = b"dedup:m:1"
            await client.hset(bucket, "f", "1")  # a key of this namespace of another type
            other_row = wire.row(shared.gateway_id, 1, "Lx#2", keys.key("email", digest("o")),
                                 "email", "o", None)  # fmt: skip

            def forged(key: bytes, token: bytes, message: bytes) -> bytes:
                return len(key).to_bytes(2, "big") + key + token + b"|" + message

            message = other_row.partition(b"|")[2]  # a real row's message, another lease
            junk = [
                forged(queued_key, b"Lclaimant#7", message),
                forged(b"elsewhere:key", b"Lx#1", message),
                forged(bucket, b"Lx#3", message),
            ]
            before = a.stats().shared_bad_messages
            await client.rpush(shared._queue_key, *junk)
            await until("the junk to be read", lambda: a.stats().shared_bad_messages >= before + 3)
            assert await client.get(queued_key) == b"Lclaimant#7"  # queued again
            assert 0 < await client.pttl(queued_key) <= SHARED.get("lease_ms", 5000)
            assert await client.get(b"elsewhere:key") == b"Lx#1"
            assert await client.pttl(b"elsewhere:key") == -1
            assert await client.hgetall(bucket) == {b"f": b"1"}
            # The writer goes on writing.
            assert (await a.save("email", "after@example.com")).created
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def _writer_behind_proxy(
    redis_url: str, pg_url: str, options: dict[str, Any]
) -> AsyncIterator[tuple[SlowProxy, Gateway, Gateway]]:
    """The fleet's writer, its Redis reached through a :class:`SlowProxy` (to lose its
    answers), and a claimant on Redis directly, both listening."""
    parts = urlsplit(redis_url)
    assert parts.hostname is not None and parts.port is not None
    async with (
        SlowProxy(parts.hostname, parts.port) as proxy,
        Gateway(proxy.url, pg_url, **options) as writer,
    ):
        await until("a writer", lambda: _shared(writer).writer)
        async with Gateway(redis_url, pg_url, **options) as claimant:
            await until("listening", lambda: _shared(claimant).active)
            yield proxy, writer, claimant


async def test_a_pop_whose_answer_is_lost_is_answered_again(redis_url: str, pg_url: str) -> None:
    """The writer's pop runs on the server and its answer is lost on the way back (the
    connection drops): the pop is sent again on a new connection and the script answers
    it from its copy, so the writer writes the popped rows at once, rather than leave
    them held by its term, answered by no one until their holds expire and their
    claimants write them."""
    values = [("email", f"lostpop{i}@example.com") for i in range(40)]
    options: dict[str, Any] = {**SHARED, "namespace": "lost-pop"}
    async with _writer_behind_proxy(redis_url, pg_url, options) as (proxy, writer, claimant):
        # The writer's shared connection sends the pop script; its answer carries the
        # rows, values in clear.
        proxy.lose_reply(_POP.sha.encode(), b"lostpop")
        results = await asyncio.wait_for(claimant.save_many(values), WAIT_S)
        mine = claimant.stats()
    written = writer.stats().db_rows_sent
    assert proxy.lost == 1, "the pop's answer was not dropped: the test tested nothing"
    assert [r.created for r in results] == [True] * len(values)
    assert mine.shared_rows_queued == len(values)
    # Every row went through the writer's statement; none was left to its claimant.
    assert mine.db_rows_sent == 0, f"the claimant wrote {mine.db_rows_sent} stranded rows"
    assert written == len(values)
    assert await table(pg_url) == set(values)


async def test_a_blocking_pop_whose_answer_is_lost_ends_the_writers_term(
    redis_url: str, pg_url: str
) -> None:
    """The writer's blocking pop (the queue was empty) takes a row on the server and its
    answer is lost on the way back: it is not sent again (a second pop would leave that
    row, off the queue and not held, to its caller's deadline, here two minutes away);
    the writer's term ends instead, and the claimant takes its row back and writes it
    at once."""
    options: dict[str, Any] = {**SHARED, "namespace": "lost-blpop", "wait_timeout_s": 120.0}
    async with _writer_behind_proxy(redis_url, pg_url, options) as (proxy, writer, claimant):
        proxy.lose_reply(b"BLPOP", b"lostblpop")
        # The blocking pop in flight was sent before that and keeps its answer; the
        # writer sends the next within 0.1 s (when that one times out).
        await until("a blocking pop sent after that", lambda: proxy.armed > 0)
        for i in range(5):
            # Saved while the writer waits on the empty queue, the row is its blocking
            # pop's (a statement's end races the claimant's next row to the queue, and
            # the writer's first look after it is an ordinary pop). A blocking pop that
            # times out just as the row arrives leaves it to the other pop: then the
            # next value's row is the blocking pop's.
            await until("the writer's blocking pop", lambda: _shared(writer)._blocking)
            save = claimant.save("email", f"lostblpop{i}@example.com")
            result = await asyncio.wait_for(save, WAIT_S)  # far below the deadline
            assert result.created
            if proxy.lost:
                break
        mine = claimant.stats()
    assert proxy.lost == 1, "no blocking pop's answer was dropped: the test tested nothing"
    assert mine.shared_rows_queued == i + 1
    assert mine.db_rows_sent == 1  # the row the writer never got, written by its claimant


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
async def test_malformed_stale_and_forged_answers_resolve_nothing(
    redis_url: str, pg_url: str, secret: str | None
) -> None:
    """Answers that are junk, stale (another nonce), meant for another gateway, or (with a
    secret) not signed with it resolve nothing and leave the listener working: the claim
    gets its writer's real answer."""
    options: dict[str, Any] = {**SHARED, "lease_ms": 4000, "shared_secret": secret}
    client = Redis.from_url(redis_url)
    try:
        async with (
            _slow_writer(redis_url, pg_url, 1.0, options),
            Gateway(redis_url, pg_url, **options) as claimant,
        ):
            shared = _shared(claimant)
            await until("listening", lambda: shared.active)
            task = asyncio.create_task(claimant.save("email", "pending@example.com"))
            await until("the row to be queued", lambda: bool(shared._pending))
            key, entry = next(iter(shared._pending.items()))
            nonce = entry.nonce
            gw, wire = shared.gateway_id, shared._wire
            forger = Wire(sink=wire.sink, secret=b"another-secret-of-enough-length",
                          keys=KeySpace("dedup"), limits=Limits(max_value_bytes=100,
                          max_payload_bytes=100))  # fmt: skip
            lies = [
                b"garbage",
                b"|[1, 2, 3]",
                wire.answer(gw, {"i": [key.hex(), nonce + 1]}),  # stale: another claim
                wire.answer("0" * 16, {"i": [key.hex(), nonce]}),  # another gateway's
                wire.answer(gw, {"i": ["zz", nonce]}),
            ]
            if secret:  # the right claim, but not signed with the fleet's secret
                lies.append(forger.answer(gw, {"i": [key.hex(), nonce]}))
                lies.append(b"|" + wire.answer(gw, {"i": [key.hex(), nonce]}).partition(b"|")[2])
            for lie in lies:
                await client.publish(shared._channel, lie)
            await asyncio.sleep(0.3)
            assert not task.done(), "a lie resolved the save"
            assert (await asyncio.wait_for(task, WAIT_S)) == SaveResult(True, "write")
            assert claimant.stats().shared_bad_messages >= len(lies) - 2
            # The listener survived: the next save is answered through it too.
            assert (await claimant.save("email", "after@example.com")).created
            assert claimant.stats().shared_rows_queued == 2
    finally:
        await client.aclose()
    assert ("email", "pending@example.com") in await table(pg_url)


async def test_rows_queued_behind_a_statement_in_flight_are_taken_when_it_ends(
    redis_url: str, pg_url: str
) -> None:
    """Rows queued while the writer's statement is in flight gather in the queue and are
    taken when it ends, in one statement; the pop behind it looks at the queue every
    four ``shared_linger_ms`` at most meanwhile (half a statement's worth would go at
    once), not every ``shared_linger_ms``."""
    linger_s, statement_s = 0.1, 1.0
    options: dict[str, Any] = {**SHARED, "lease_ms": 4000, "shared_linger_ms": linger_s * 1000}
    async with (
        _slow_writer(redis_url, pg_url, statement_s, options) as writer,
        Gateway(redis_url, pg_url, **options) as claimant,
    ):
        await until("listening", lambda: _shared(claimant).active)
        shared = _shared(writer)
        takes: list[float] = []
        take = shared._take

        async def counted(count: int, popped: bytes | None = None) -> Any:
            takes.append(time.monotonic())
            return await take(count, popped)

        shared._take = counted  # counts the writer's pops; they still run against Redis
        first = asyncio.create_task(claimant.save("email", "first@example.com"))
        await until("the first statement", lambda: writer.stats().shared_statements == 1)
        started = time.monotonic()
        rest = [claimant.save("email", f"behind{i}@example.com") for i in range(5)]
        behind = asyncio.gather(*rest)
        assert (await asyncio.wait_for(first, WAIT_S)).created
        assert all(r.created for r in await asyncio.wait_for(behind, WAIT_S))
        stats = writer.stats()
        during = [t for t in takes if started <= t < started + statement_s]
    assert stats.shared_statements == 2, "the five rows behind the first were not one statement"
    # Every 4 x 0.1 s: two or three pops in the first statement's second, where a pop every
    # 0.1 s made ten.
    assert 1 <= len(during) <= 4, len(during)
    assert len(await table(pg_url)) == 6


# ------------------------------------------------------------------ bounded waits and queue


async def test_hot_key_queued_behind_a_slow_writer_keeps_its_lease(
    redis_url: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A slow (but alive) writer with a backlog of several leases: the claimant of a hot
    key renews its lease while its row waits, so the other gateway never claims it; the
    row is written (by the writer, or by its claimant once the caller's deadline nears).
    No caller gets WaitTimeout."""
    # A 2 s lease: the three gateways share this test's event loop, and a stall of a
    # loaded CI box past a 1 s lease's renewals ended the writer's term (one run in
    # many), after which the claimant rightly took its row back at once.
    lease_s = 2.0
    options: dict[str, Any] = {**SHARED, "lease_ms": 2000, "wait_timeout_s": 4 * lease_s}
    ledger = Ledger()
    # Statements of 0.3 s: inside the 1 s statement bound, so the writer is alive, slow.
    async with (
        _slow_writer(redis_url, pg_url, 0.3, {**options, "max_batch": 8}),
        Gateway(redis_url, pg_url, **options) as a,
        Gateway(redis_url, pg_url, **options) as b,
    ):
        await until("listening", lambda: _shared(a).active and _shared(b).active)
        backlog = [("email", f"backlog{i}") for i in range(400)]  # ~15 s of statements
        first = asyncio.create_task(a.save_many(backlog))
        await until("a backlog", lambda: a.stats().shared_rows_queued >= 400)
        hot = ("email", "hot@example.com")
        key = a._keys.key("email", digest("hot@example.com"))
        token = _shared(a)._claims.token
        mine = asyncio.create_task(a.save(*hot))
        await until("the hot row to be queued", lambda: key in _shared(a)._pending)
        queued_at = time.monotonic()
        client = Redis.from_url(redis_url)
        seen: list[bytes | None] = []
        try:

            async def others() -> None:  # b's callers of the hot key meanwhile
                while not mine.done():
                    r = await b.save(*hot)
                    ledger.record(hot, r)

            hammer = asyncio.create_task(others())
            while not mine.done():
                seen.append(cast(bytes | None, await client.get(key)))
                await asyncio.sleep(0.02)
            waited = time.monotonic() - queued_at
            ledger.record(hot, await mine)
            await asyncio.wait_for(hammer, WAIT_S)
        finally:
            await client.aclose()
        ledger.record_all(backlog, await asyncio.wait_for(first, WAIT_S))
        stats = a.stats()
    await check_contract(
        capsys, "hot key behind a slow writer", pg_url, ledger,
        hot_waited_s=round(waited, 2), taken_back=stats.shared_rows_returned,
        wait_timeouts=stats.wait_timeouts,
    )  # fmt: skip
    assert waited > 1.5 * lease_s  # it did wait well past its first lease
    # Only a's claims ever held it: queued (token#nonce), held by the writer
    # (token#nonce@term), or a's own again (taken back). The writer's commit deletes the
    # lease key (the marker is in its bucket) in the round trip that publishes a's word, so
    # reads answered before a handles that word may end the list with no key: not a gap.
    while seen and seen[-1] is None:
        seen.pop()
    assert seen and all(v is not None and v.startswith(token.encode()) for v in seen), set(seen)
    assert ledger.acks[hot].count(True) == 1
    assert not ledger.errors


async def test_a_row_too_close_to_its_deadline_is_written_by_its_claimant(
    redis_url: str, pg_url: str
) -> None:
    """A winner whose caller cannot wait for the writer and still leave a write budget
    before its deadline is not queued: its claimant writes it (created=True), rather
    than queueing it and having its take-back come due at once, or after the deadline."""
    async with Gateway(redis_url, pg_url, namespace="near-deadline", **NEAR_DEADLINE) as near:
        await until("listening", lambda: _shared(near).active)
        results = await near.save_many([("email", f"near{i}") for i in range(50)])
        assert all(r.created for r in results)
        assert near.stats().shared_rows_queued == 0
    async with Gateway(redis_url, pg_url, namespace="near-deadline", **SHARED) as far:
        await until("listening", lambda: _shared(far).active)
        results = await far.save_many([("email", f"far{i}") for i in range(50)])
        assert all(r.created for r in results)
        assert far.stats().shared_rows_queued > 0


async def test_a_writer_of_one_row_a_statement_pops_one_row(redis_url: str, pg_url: str) -> None:
    """``max_batch=1``: every statement of the fleet's writer has one row, even when its
    blocking pop finds a queue of many (a pop for the rest, 0 rows, takes none)."""
    sink = open_sink(pg_url, pool_size=4, statement_timeout_ms=5000)
    sizes: list[int] = []

    async def write(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        sizes.append(len(rows))
        return await sink(rows)

    write.identity = sink.identity  # type: ignore[attr-defined]
    await sink.open()
    try:
        async with Gateway(redis_url, sink=write, max_batch=1, **SHARED) as writer:
            await until("a writer", lambda: _shared(writer).writer)
            async with Gateway(redis_url, pg_url, **SHARED) as claimant:
                await until("listening", lambda: _shared(claimant).active)
                values = [("email", f"one{i}") for i in range(60)]
                results = await claimant.save_many(values)  # one claim queues all 60
                queued = claimant.stats().shared_rows_queued
    finally:
        await sink.aclose()
    assert all(r.created for r in results)
    assert queued > 0 and sizes
    assert max(sizes) == 1, sizes


async def test_answered_rows_leave_the_wait_heap(redis_url: str, pg_url: str) -> None:
    """A row queued for the writer is rechecked near its caller's deadline, seconds
    away; once the writer's word has answered it, its flight (the callers' futures, the
    value) must not stay in the wait heap until then: the heap drops answered entries as
    it grows, so it holds about what is still waiting, not every value of the last
    ``wait_timeout_s``."""
    async with Gateway(redis_url, pg_url, **SHARED) as writer:
        await until("a writer", lambda: _shared(writer).writer)
        async with Gateway(redis_url, pg_url, **SHARED) as claimant:
            await until("listening", lambda: _shared(claimant).active)
            engine = claimant._engine
            assert engine is not None
            largest = 0
            for round_ in range(40):
                values = [("email", f"heap{round_}-{i}") for i in range(50)]
                results = await claimant.save_many(values)  # one claim queues all 50
                assert all(r.created for r in results)
                largest = max(largest, len(engine.waits))
            queued = claimant.stats().shared_rows_queued
    assert queued == 2000, queued  # every row went to the writer and was rechecked
    # Answered entries are dropped once the heap has doubled since the last purge: at
    # most 64 (the first purge) plus a round's 50, never the 2,000 values answered.
    assert largest <= 64 + 50, largest
    assert len(await table(pg_url)) == 2000


async def test_a_due_row_whose_take_back_is_under_way_still_gets_an_answer(
    redis_url: str, pg_url: str
) -> None:
    """A queued row's deadline re-check comes while another take-back of the same row (a
    renewal's, or an "r" word's) is under way, which leaves it with the writer, and the
    writer's word is then lost: the caller must still get an answer, here by claiming
    the value again once nobody holds it, not wait for ever."""
    async with Gateway(redis_url, pg_url, namespace="due-race", **SHARED) as gw:
        engine, shared = gw._engine, _shared(gw)
        assert engine is not None
        # Its own writer, popping: the renewals see a live term and leave the row be.
        await until("a writer", lambda: shared.writer)
        loop = asyncio.get_running_loop()
        kind, value = "email", "due@example.com"
        d = digest(value)
        key = gw._keys.key(kind, d)
        waiter: asyncio.Future[Any] = loop.create_future()
        flight = Flight(key, kind, value, d, None, waiter, loop.time() + WAIT_S)
        flight.shared = True  # its row went to the writer's queue
        engine.flights.inflight[key] = flight
        entry = _Queued(flight, 1, f"{shared._claims.token}#1", None)
        shared._pending[key] = entry
        entry.returning = True  # the other take-back, under way
        await shared.take_back([flight], due=True)  # the claim stage's deadline re-check
        entry.returning = False  # it ends: the row stays the writer's, whose word is lost
        # No lease holds the value: the next look takes it over and writes it here.
        assert await asyncio.wait_for(waiter, WAIT_S) == "write"


async def test_full_queue_claimants_write_their_own_rows(
    redis_url: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    options: dict[str, Any] = {**SHARED, "shared_queue_max": 20}
    ledger = Ledger()
    client = Redis.from_url(redis_url)
    try:
        # Claim batches of 8: each pushes 8 rows, so a third one finds the queue full.
        async with (
            _slow_writer(redis_url, pg_url, 0.2, {**options, "max_batch": 4}),
            Gateway(redis_url, pg_url, max_batch=8, **options) as gw,
        ):
            await until("listening", lambda: _shared(gw).active)
            longest = 0
            done = asyncio.Event()

            async def watch() -> None:
                nonlocal longest
                while not done.is_set():
                    longest = max(longest, await client.llen(_shared(gw)._queue_key))
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            values = [("email", f"full{i}") for i in range(300)]
            for start in range(0, 300, 30):
                chunk = values[start : start + 30]
                ledger.record_all(chunk, await gw.save_many(chunk))
            # Stopped by a flag and awaited, not cancelled: a LLEN cut off while its
            # connection is being made left its socket to the garbage collector (a
            # ResourceWarning, once in ~10 runs), and a cancellation swallowed inside
            # redis-py kept the loop running until the test's timeout (once, on 6.2).
            done.set()
            await asyncio.wait_for(watcher, WAIT_S)
            stats = gw.stats()
    finally:
        await client.aclose()
    await check_contract(
        capsys, "shared queue at its cap", pg_url, ledger, longest_queue=longest,
        queue_full=stats.shared_queue_full, queued=stats.shared_rows_queued,
    )  # fmt: skip
    assert longest <= 20
    assert stats.shared_queue_full > 0 and stats.shared_rows_queued > 0
    assert all(flags == [True] for flags in ledger.acks.values())


async def test_survivor_of_a_killed_writer_drains_within_a_lease(
    redis_url: str,
    pg_url: str,
    spawn: Callable[[dict[str, Any]], Child],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A fleet of two with the default mode and lease: the writer is SIGKILLed. The
    survivor still counts it until its writer lease has passed (the heartbeat outlives
    it), takes the role over and drains the queue within about a lease."""
    lease_s = 5.0  # the default, where the heartbeat once expired before the writer lease
    writer = spawn(
        {
            "mode": "save",
            "redis_url": redis_url,
            "database_url": pg_url,
            "items": [["email", "child"]],
            "concurrency": 1,
            "out": str(tmp_path / "child.jsonl"),
            "name": "writer",
            "options": {"shared_writes": "on"},  # it stands at once, alone
        }
    )
    assert writer.read_line() == "READY"
    ledger = Ledger()
    client = Redis.from_url(redis_url)
    async with Gateway(redis_url, pg_url) as gw:  # the defaults: "auto", a 5 s lease
        shared = _shared(gw)
        await until("a fleet of two", lambda: shared.active)

        async def writer_lease() -> bool:
            return bool(await client.exists(shared._writer_key))

        while not await writer_lease():  # the child holds it (bounded by WAIT_S below)
            await until("a moment", lambda: True)
        assert not shared.writer  # the child writes for the fleet
        writer.kill()
        killed = time.monotonic()
        values = [("email", f"orphan{i}") for i in range(100)]
        ledger.record_all(values, await gw.save_many(values))
        answered = time.monotonic() - killed
        took_over = await until("the survivor to write for the fleet", lambda: shared.writer)
        await until("the queue drained", lambda: not shared._pending)
        left = await client.llen(shared._queue_key)
        stats = gw.stats()
    await client.aclose()
    await check_contract(
        capsys, "writer of two SIGKILLed", pg_url, ledger,
        answered_s=round(answered, 2), took_over_s=round(took_over, 2),
        queued=stats.shared_rows_queued,
    )  # fmt: skip
    assert stats.shared_rows_queued == 100  # queued for the dead writer
    assert all(flags == [True] for flags in ledger.acks.values())
    assert answered < lease_s + 2.0, f"answered {answered:.1f} s after the kill"
    assert took_over < lease_s + 2.0
    assert left == 0


async def test_every_gateway_learns_what_the_writer_saved(
    spawn: Callable[[dict[str, Any]], Child], redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    """A value saved through another process is answered by this process's local tier,
    with no Redis call: the fleet's writer broadcasts each statement's saved values on
    one channel and every gateway's local tier learns them."""
    values = [f"learn{i}@example.com" for i in range(300)]
    child = spawn(
        {
            "mode": "save",
            "redis_url": redis_url,
            "database_url": pg_url,
            "items": [["email", v] for v in values],
            "concurrency": 16,
            "out": str(tmp_path / "child.jsonl"),
            "name": "saver",
            "options": SHARED,
        }
    )
    assert child.read_line() == "READY"
    async with Gateway(redis_url, pg_url, **SHARED) as gw:
        await until("listening", lambda: _shared(gw).active)
        child.send("go\n")
        while not child.read_line().startswith("{"):  # the child's stats, then DONE
            pass
        # Bounded: learning follows each statement's commit by one PUBLISH.
        await until("every value learned", lambda: gw.stats().shared_learned >= len(values))
        before = gw.stats()
        results = await gw.save_many([("email", v) for v in values])
        after = gw.stats()
    assert [r.source for r in results] == ["local"] * len(values)
    assert not any(r.created for r in results)
    assert after.redis_round_trips == before.redis_round_trips  # no claim, no Redis call
    assert after.local - before.local == len(values)
    assert len(await table(pg_url)) == len(values)  # learned only what has a row


async def test_every_gateway_learns_what_a_claimant_wrote_itself(
    redis_url: str, pg_url: str
) -> None:
    """Rows a gateway of the fleet writes itself, not through the writer (here, too near
    their callers' deadline to queue), are announced too: another gateway answers them
    from its local tier, with no Redis call."""
    values = [("email", f"self-written{i}") for i in range(50)]
    async with Gateway(redis_url, pg_url, **SHARED) as learner:
        await until("a writer", partial(_is_writer, learner))
        async with Gateway(redis_url, pg_url, **NEAR_DEADLINE) as near:
            await until("listening", lambda: _shared(near).active)
            assert all(r.created for r in await near.save_many(values))
            wrote = near.stats()
        assert wrote.shared_rows_queued == 0 and wrote.shared_rows_own == 0
        await until("learned", lambda: learner.stats().shared_learned >= len(values))
        before = learner.stats()
        results = await learner.save_many(values)
        after = learner.stats()
    assert [r.source for r in results] == ["local"] * len(values)
    assert after.redis_round_trips == before.redis_round_trips
    assert len(await table(pg_url)) == len(values)


async def test_learning_can_be_turned_off_and_forged_broadcasts_teach_nothing(
    redis_url: str, pg_url: str
) -> None:
    """``shared_learn=False``: a gateway learns only its own values. With
    ``shared_secret``, a saved-values message from a client without the secret is
    counted and skipped, so nobody can make a gateway answer "saved" for a value
    with no row."""
    secret: dict[str, Any] = {"shared_secret": "a-secret-of-16-chars-or-more"}
    async with (
        Gateway(redis_url, pg_url, **SHARED, **secret) as learner,
        Gateway(redis_url, pg_url, **SHARED, **secret, shared_learn=False) as deaf,
    ):
        await until("listening", lambda: _shared(learner).active and _shared(deaf).active)
        saved = [("email", f"mine{i}") for i in range(50)]
        await learner.save_many(saved)
        await until("learned", lambda: learner.stats().shared_learned >= len(saved))
        assert deaf.stats().shared_learned == 0
        # A forged message: the right channel and format, a wrong signature.
        shared = _shared(learner)
        forger = Wire(
            sink=shared._wire.sink,
            secret=b"not-the-secret-at-all",
            keys=learner._keys,
            limits=learner._limits,
        )
        fake = Row("email", digest("never-saved"), "never-saved", None)
        client = Redis.from_url(redis_url)
        try:
            bad_before = learner.stats().shared_bad_messages
            learned_before = learner.stats().shared_learned
            assert await client.publish(shared._saved_channel, forger.saved([fake])) >= 1
            await until(
                "the forgery counted", lambda: learner.stats().shared_bad_messages > bad_before
            )
        finally:
            await client.aclose()
        assert learner.stats().shared_learned == learned_before
        r = await learner.save("email", "never-saved")
        assert r.created and r.source == "write"  # not answered "saved" by the forgery


async def test_a_busy_value_is_answered_by_the_writers_broadcast(
    redis_url: str, pg_url: str
) -> None:
    """A value that another gateway holds (busy) is answered when the fleet's writer
    broadcasts its row as saved, not at its next claim: here that claim would come only
    after a minute's backoff, and the answer comes within seconds, with no claim since
    the one that found it busy."""
    options: dict[str, Any] = {**SHARED, "lease_ms": 3000}
    async with Gateway(redis_url, pg_url, **options) as claimant:
        _shared(claimant)._rest_until = float("inf")  # it never stands
        # The writer's statements: slow enough to be caught.
        async with _slow_writer(redis_url, pg_url, 0.3, options) as writer:
            await until("both listening", lambda: _shared(claimant).active)
            saving = asyncio.ensure_future(writer.save("email", "busy@example.com"))
            await until("the writer's statement in flight", lambda: _shared(writer)._writing)
            waits = claimant._engine.waits  # type: ignore[union-attr]
            waits._min_backoff_s = waits._max_backoff_s = 60.0
            claims = claimant.stats().claim_batches
            started = time.monotonic()
            answer = await asyncio.wait_for(claimant.save("email", "busy@example.com"), 10)
            waited = time.monotonic() - started
            mine = await saving
        stats = claimant.stats()
    assert mine == SaveResult(created=True, source="write")
    assert answer == SaveResult(created=False, source="redis")
    assert stats.busy == 1 and stats.shared_busy_answered == 1
    assert stats.claim_batches == claims + 1  # the claim that found it busy, no other
    assert waited < 10
    assert len(await table(pg_url)) == 1


def test_the_writer_checks_every_row_whatever_it_checked_before() -> None:
    """The writer remembers the gateway ids and kinds it found good (a fleet has few), to
    check popped rows faster: a row with a bad kind or gateway is still refused after
    good rows, and rows naming ever new gateways leave that memory bounded."""
    keys = KeySpace("dedup")
    wire = Wire(sink="0123456789abcdef", secret=b"", keys=keys,
                limits=Limits(max_value_bytes=100, max_payload_bytes=100))  # fmt: skip

    def row(gateway: str, kind: str, value: str) -> bytes:
        return wire.row(gateway, 1, "L1", keys.key(kind, digest(value)), kind, value, None)

    good = wire.read_row(row("a" * 16, "email", "x@example.com"))
    assert (good.gateway, good.row.kind) == ("a" * 16, "email")
    for bad_kind in ("email\n", "", "e\u200bmail"):
        with pytest.raises(BadMessage, match="not a valid save"):
            wire.read_row(row("a" * 16, bad_kind, "x@example.com"))
    for bad_gateway in ("A" * 16, "a" * 15, "a" * 17, "g" * 16):
        with pytest.raises(BadMessage, match="names no gateway"):
            wire.read_row(row(bad_gateway, "email", "x@example.com"))
    for i in range(5000):
        wire.read_row(row(f"{i:016x}", "email", f"v{i}"))
    assert len(wire._gateways) <= 4096
    with pytest.raises(BadMessage, match="names no gateway"):
        wire.read_row(row("b" * 15, "email", "x@example.com"))


async def test_a_writer_that_closes_gives_up_the_role_before_it_returns(
    redis_url: str, pg_url: str
) -> None:
    """A writer gateway closed cleanly gives up the writer lease and ends its term before
    ``aclose`` returns, and tells the other gateways, so that rows queued for it are taken
    back, and another gateway stands, at once. Before, the term's key outlived the writer
    by a writer lease, and a gateway left alone with rows queued waited that long for
    them (6.4 s in a 4-process bench whose writer finished first); with the key gone but
    no word, up to a renewal (a third of a lease)."""
    client = Redis.from_url(redis_url)
    try:
        async with Gateway(redis_url, pg_url, **{**SHARED, "lease_ms": 5000}) as other:
            _shared(other)._rest_until = float("inf")  # it never stands while w writes
            w = Gateway(redis_url, pg_url, **{**SHARED, "lease_ms": 5000})
            await w.open()
            try:
                await until("a writer", partial(_is_writer, w))
                shared = _shared(w)
                assert await client.exists(shared._writer_key)
                await other.save_many([("email", f"before{i}") for i in range(50)])
                nudges = _shared(other)._nudges  # w's arrival was one
            finally:
                await w.aclose()
            # Its term ended with it, and the other gateway heard so: claimants waiting
            # for it take their rows back, and candidates stand, at once, not once the
            # term's key expires a writer lease later.
            assert not await client.exists(shared._writer_key)
            assert not await client.exists(shared._term_key)
            await until("the end of the term heard", lambda: _shared(other)._nudges > nudges)
            _shared(other)._rest_until = 0.0
            started = time.monotonic()
            await until("the other writes", partial(_is_writer, other))
            assert time.monotonic() - started < 3.0  # a try is a third of a lease apart
            results = await other.save_many([("email", f"after{i}") for i in range(50)])
            assert all(r.created for r in results)
    finally:
        await client.aclose()


async def test_the_writer_writes_its_own_winners_without_queuing_them(
    redis_url: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """While it writes for the fleet (and is not waiting on an empty queue), the writer's
    own winners join its next statement straight away: not queued, not checked, not
    answered over Redis. Both gateways race on every value, the writer's statements are
    slow (so that it is busy), and every value still has exactly one ``created=True``,
    while the writer writes and once it has left."""
    ledger = Ledger()
    async with Gateway(redis_url, pg_url, **SHARED) as claimant:
        _shared(claimant)._rest_until = float("inf")  # it never stands
        async with (
            _slow_writer(redis_url, pg_url, 0.05, SHARED) as writer,
            loaded([writer, claimant], ledger, both=True) as load,
        ):
            await load.grows_by(1500, "saves while the writer writes")
            await until(
                "own rows in the writer's statements",
                lambda: writer.stats().shared_rows_own > 0,
            )
        async with loaded([claimant], ledger, both=True) as load:
            await load.grows_by(300, "saves after the writer left")
        stats = [writer.stats(), claimant.stats()]
    rows = await check_contract(
        capsys, "the writer's own winners", pg_url, ledger,
        own=stats[0].shared_rows_own, writer_queued=stats[0].shared_rows_queued,
        claimant_queued=stats[1].shared_rows_queued,
    )  # fmt: skip
    assert stats[0].shared_rows_own > 0 and stats[1].shared_rows_queued > 0
    assert not ledger.errors
    missing = [k for k in rows if ledger.acks.get(k, []).count(True) != 1]
    assert not missing, f"{len(missing)} of {len(rows)} rows had no created=True: {missing[:5]}"


async def test_a_gateway_that_joins_makes_the_others_count_the_fleet_at_once(
    redis_url: str, pg_url: str
) -> None:
    """With ``shared_writes="auto"``, a gateway alone writes its own rows; when a second
    gateway of the sink joins, its first heartbeat says so, and the first counts the
    fleet again at once (not at its next beat, up to a second later) and shares its
    writes from then on."""
    options: dict[str, Any] = {"lease_ms": 800, "wait_timeout_s": WAIT_S}
    async with Gateway(redis_url, pg_url, **options) as first:
        await until("listening", lambda: _shared(first)._listening)
        await asyncio.sleep(0.1)
        assert not _shared(first).active  # a fleet of one
        heard = _shared(first)._nudges
        async with Gateway(redis_url, pg_url, **options) as second:
            await until("the arrival heard", lambda: _shared(first)._nudges > heard)
            await until("a fleet of two", lambda: _shared(first).active)
            results = await first.save_many([("email", f"joined{i}") for i in range(20)])
            assert all(r.created for r in results)
            assert _shared(second).active
