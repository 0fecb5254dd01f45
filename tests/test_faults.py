"""Fault injection against real processes: the contract holds through every fault.

Each scenario injects one fault under load, then checks, from the table and from
the callers' own records of what they were told:

- every acknowledged value is in the table (``lost`` = 0);
- no value got two ``created=True``, and ``created`` is True exactly for ``write``;
- no duplicate rows (one row per (kind, digest), and the digest is the value's);
- the gateway serves again by itself once the fault is gone.

The figures (acknowledged, errors, lost, ...) go straight to the terminal with
``capsys.disabled()``, so they show in the CI log without ``-s``.

Covered elsewhere, not repeated here: a SIGKILLed lease holder taken over after its
lease (tests/test_processes.py, tests/test_multiprocess.py), Redis FLUSHALLed
mid-run and Redis killed and restarted within a fraction of a second
(tests/test_gateway.py), the database down with 503 + Retry-After over HTTP
(tests/test_service_ops.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import pytest
from redis.asyncio import Redis

from dedup import DedupError, Gateway, Overloaded, Row, SaveResult, Unavailable, WaitTimeout
from dedup._values import digest
from dedup.store import pg_insert
from dedup.store.migrate import upgrade_async
from tests.servers import PostgresCluster, RedisServer
from tests.slow_proxy import SlowProxy
from tests.test_processes import Child, markers
from tests.test_service import request, service_env, spawn_service, wait_exit, wait_healthy

WAIT_S = 30.0  # bound of every "until" below: generous, the faults last a few seconds
Key = tuple[str, str]


# ------------------------------------------------------------------------------ helpers


@dataclass
class Ledger:
    """What the callers were told: the ``created`` flags of each value's acknowledgements,
    and the errors they got, by type."""

    acks: dict[Key, list[bool]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    attempted: set[Key] = field(default_factory=set)

    @property
    def acknowledged(self) -> int:
        return sum(map(len, self.acks.values()))

    def record(self, key: Key, result: SaveResult) -> None:
        assert result.created == (result.source == "write"), result
        self.acks.setdefault(key, []).append(result.created)

    def record_all(self, keys: Sequence[Key], results: Sequence[SaveResult]) -> None:
        """The answers of a batch (``save_many``), one per key, in order."""
        for key, result in zip(keys, results, strict=True):
            self.record(key, result)

    def record_line(self, line: dict[str, Any]) -> None:
        """One answer of a child (``tests/child.py``'s JSON line)."""
        key = (line["kind"], line["value"])
        self.attempted.add(key)
        if "error" in line:
            self.errors[line["error"].split("(", 1)[0]] += 1
        else:
            self.record(key, SaveResult(line["created"], line["source"]))


async def table(pg_url: str) -> set[Key]:
    """The rows, checked: one per (kind, digest), each digest that of its value."""
    conn = await asyncpg.connect(pg_url)
    try:
        records = await conn.fetch("SELECT kind, digest, value FROM dedup_items")
    finally:
        await conn.close()
    for r in records:
        assert bytes(r["digest"]) == digest(r["value"])
    rows = [(r["kind"], r["value"]) for r in records]
    assert len(rows) == len(set(rows)), "duplicate rows"
    return set(rows)


async def check_contract(
    capsys: pytest.CaptureFixture[str], scenario: str, pg_url: str, ledger: Ledger, **extra: Any
) -> set[Key]:
    """Assert the contract from the table and the ledger; print the figures; the rows."""
    rows = await table(pg_url)
    acked = {key for key, flags in ledger.acks.items() if flags}
    lost = acked - rows
    twice = {key for key, flags in ledger.acks.items() if sum(flags) > 1}
    figures = {
        "acknowledged": ledger.acknowledged,
        "errors": sum(ledger.errors.values()),
        "lost": len(lost),
        "created_twice": len(twice),
        "values": len(acked),
        "rows": len(rows),
        **extra,
    }
    text = " ".join(f"{k}={v}" for k, v in figures.items())
    kinds = dict(ledger.errors)
    with capsys.disabled():
        print(f"\n[fault] {scenario}: {text} error_types={kinds}", flush=True)
    assert not lost, f"acknowledged but not in the table: {sorted(lost)[:5]}"
    assert not twice, f"created=True twice: {sorted(twice)[:5]}"
    return rows


async def until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> float:
    """Wait (polling) until ``check()`` holds; the seconds it took. Fails after ``timeout_s``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"gave up waiting for {what} after {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


class Load:
    """Coroutines saving a stream of values (mostly new, some repeats) until stopped."""

    def __init__(
        self, gateways: Sequence[Gateway], ledger: Ledger, *, concurrency: int = 16, both: bool
    ) -> None:
        self.gateways = gateways
        self.ledger = ledger
        self.both = both  # every value to every gateway at once (they race), or round robin
        self.counter = itertools.count()
        self.stop = asyncio.Event()
        self.rng = random.Random(7)
        self.tasks = [asyncio.create_task(self._worker(n)) for n in range(concurrency)]

    def _next(self) -> Key:
        i = next(self.counter)
        if i > 10 and self.rng.random() < 0.2:
            i = self.rng.randrange(i)  # a repeat
        return ("email", f"u{i}@example.com")

    async def _one(self, gw: Gateway, key: Key) -> None:
        self.ledger.attempted.add(key)
        try:
            result = await gw.save(*key)
        except DedupError as exc:
            self.ledger.errors[type(exc).__name__] += 1
            await asyncio.sleep(0.01)  # a caller backs off a little after an error
        else:
            self.ledger.record(key, result)

    async def _worker(self, n: int) -> None:
        while not self.stop.is_set():
            key = self._next()
            if self.both:
                await asyncio.gather(*(self._one(gw, key) for gw in self.gateways))
            else:
                await self._one(self.gateways[n % len(self.gateways)], key)

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), WAIT_S)

    async def grows_by(self, n: int, what: str) -> None:
        """Wait until ``n`` more saves have been acknowledged."""
        target = self.ledger.acknowledged + n
        await until(what, lambda: self.ledger.acknowledged >= target)


@contextlib.asynccontextmanager
async def loaded(gateways: Sequence[Gateway], ledger: Ledger, *, both: bool) -> AsyncIterator[Load]:
    load = Load(gateways, ledger, both=both)
    try:
        yield load
    finally:
        await load.finish()


async def leases_held(redis_url: str) -> int:
    """How many keys of the default namespace hold a value's lease token (string keys
    whose value starts with L). Marker buckets (hashes) and the shared writes' keys
    (a set, a list, the writer lease whose token is hex) are not leases of values."""
    client = Redis.from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=b"dedup:*", count=1000)]
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.type(key)
            types: list[Any] = await pipe.execute()
        strings = [k for k, t in zip(keys, types, strict=True) if t == b"string"]
        values: list[Any] = await client.mget(strings) if strings else []
    finally:
        await client.aclose()
    return sum(1 for v in values if isinstance(v, bytes) and v[:1] == b"L")


async def resave_after(capsys: pytest.CaptureFixture[str], redis_url: str, pg_url: str,
                       ledger: Ledger, scenario: str) -> Counter[str]:  # fmt: skip
    """A new Gateway (empty local tier) saves every acknowledged value again.

    A value with a "saved" marker answers from Redis; one without (saved while
    degraded, or its marker lost with a restarted Redis) is claimed, its insert
    conflicts and it answers ``db``, created=False; either way it ends with a marker.
    """
    acked = sorted(key for key, flags in ledger.acks.items() if flags)
    before = await markers(redis_url, acked)
    results: list[SaveResult] = []
    # Its own leases long enough for a loaded machine's writes (half a lease each: with
    # lease_ms=1000 a batch insert timed out at 0.5 s); the leases the faulted gateways
    # left expire on their own clocks, whatever this one's.
    async with Gateway(redis_url, pg_url, lease_ms=10_000, wait_timeout_s=WAIT_S) as gw:
        # In slices: a fast run acknowledges more values than one batch may hold
        # (max_pending, 100,000: 101,131 in one run on Redis 6.2).
        for i in range(0, len(acked), 10_000):
            results += await gw.save_many(acked[i : i + 10_000])
    sources: Counter[str] = Counter(r.source for r in results)
    with capsys.disabled():
        print(f"[fault] {scenario}: saved again by a new gateway: {dict(sources)}", flush=True)
    for marker, result in zip(before, results, strict=True):
        expected = (False, "redis") if marker == "S" else (False, "db")
        assert (result.created, result.source) == expected, (marker, result)
    assert set(await markers(redis_url, acked)) == {"S"}
    return sources


def answers(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines a (possibly SIGKILLed) child wrote."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line]  # the last may be cut short


def count_lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


# ---------------------------------------------------------------------- gateway processes


@pytest.mark.slow
async def test_sigkill_gateway_processes_under_load(
    redis_url: str,
    pg_url: str,
    tmp_path: Path,
    spawn: Callable[[dict[str, Any]], Child],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Three gateway processes save overlapping values; two are SIGKILLed mid-run (their
    leases, batches and answers cut short). The survivor and a new gateway take over."""
    distinct = [("email", f"k{i}@example.com") for i in range(1500)]
    procs: list[tuple[Child, Path]] = []
    for n in range(3):
        items = list(distinct)
        random.Random(n).shuffle(items)
        out = tmp_path / f"answers-{n}.jsonl"
        job = {
            "mode": "save",
            "name": n,
            "redis_url": redis_url,
            "database_url": pg_url,
            "items": items,
            "concurrency": 32,
            "out": str(out),
            "stream": True,
            "options": {"lease_ms": 1000, "wait_timeout_s": WAIT_S, "max_batch": 64},
        }
        procs.append((spawn(job), out))
    for child, _ in procs:
        assert child.read_line() == "READY"
    for child, _ in procs:
        child.send("go\n")
    victims = procs[:2]
    await until("the victims to answer", lambda: all(count_lines(o) >= 100 for _, o in victims))
    for child, _ in victims:
        os.kill(child.pid, signal.SIGKILL)
    for child, _ in victims:
        assert await asyncio.to_thread(child.proc.wait, WAIT_S) == -signal.SIGKILL
    survivor, survivor_out = procs[2]
    stats = json.loads(await asyncio.to_thread(survivor.read_line, 90.0))["stats"]
    assert await asyncio.to_thread(survivor.read_line) == "DONE"

    ledger = Ledger()
    for _, out in procs:
        for line in answers(out):
            ledger.record_line(line)
    unanswered = 3 * len(distinct) - sum(len(answers(out)) for _, out in procs)
    # The gateway serves again by itself: a new one saves every value once more.
    # Its own leases long enough for a loaded machine's writes (half a lease each: with
    # lease_ms=1000 a batch insert timed out at 0.5 s); the leases the faulted gateways
    # left expire on their own clocks, whatever this one's.
    async with Gateway(redis_url, pg_url, lease_ms=10_000, wait_timeout_s=WAIT_S) as gw:
        ledger.record_all(distinct, await gw.save_many(distinct))
    rows = await check_contract(
        capsys, "SIGKILL 2 of 3 gateway processes", pg_url, ledger,
        cut_short=unanswered, survivor_busy=stats["busy"],
    )  # fmt: skip
    assert rows == set(distinct)
    assert not ledger.errors  # the survivor waited out the dead leases; nobody failed
    assert len(answers(survivor_out)) == len(distinct)


@pytest.mark.slow
async def test_sigstopped_writer_past_its_lease(
    redis_url: str,
    pg_url: str,
    tmp_path: Path,
    spawn: Callable[[dict[str, Any]], Child],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A writer is SIGSTOPped while it holds leases, for longer than the lease; another
    gateway takes its values over; the writer then wakes and finishes what it started."""
    lease_ms = 1000
    distinct = [("email", f"s{i}@example.com") for i in range(1500)]
    out = tmp_path / "stopped.jsonl"
    job = {
        "mode": "save",
        "name": "stopped",
        "redis_url": redis_url,
        "database_url": pg_url,
        "items": distinct,
        "concurrency": 32,
        "out": str(out),
        "stream": True,
        "options": {"lease_ms": lease_ms, "wait_timeout_s": WAIT_S, "max_batch": 64},
    }
    writer = spawn(job)
    assert writer.read_line() == "READY"
    writer.send("go\n")
    await until("the writer to answer", lambda: count_lines(out) >= 100)
    held = 0
    for _ in range(100):  # stop it at a moment it holds leases (nearly always at once)
        os.kill(writer.pid, signal.SIGSTOP)
        held = await leases_held(redis_url)
        if held:
            break
        os.kill(writer.pid, signal.SIGCONT)
        await asyncio.sleep(0.01)
    assert held, "never caught the writer holding a lease"
    stopped_at = time.monotonic()
    try:
        async with Gateway(redis_url, pg_url, lease_ms=lease_ms, wait_timeout_s=WAIT_S) as gw:
            results = await gw.save_many(distinct)
            stats = gw.stats()
        took_over_s = time.monotonic() - stopped_at
        # Stay stopped well past the lease, so that it wakes to a lease long gone.
        await asyncio.sleep(max(0.0, 2 * lease_ms / 1000 - (time.monotonic() - stopped_at)))
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    child_stats = json.loads(await asyncio.to_thread(writer.read_line, 90.0))["stats"]
    assert await asyncio.to_thread(writer.read_line) == "DONE"

    ledger = Ledger()
    for line in answers(out):
        ledger.record_line(line)
    ledger.record_all(distinct, results)
    rows = await check_contract(
        capsys, "SIGSTOP a writer for 2x its lease", pg_url, ledger,
        leases_held_when_stopped=held, taken_over_after_s=round(took_over_s, 2),
        busy=stats.busy, writer_lost_leases=child_stats["lost_leases"],
    )  # fmt: skip
    assert stats.busy > 0  # the new gateway found the stopped writer's leases and waited
    assert rows == set(distinct)
    # The stopped writer's late work may fail (its write timed out while it slept), but
    # it never acknowledges what is not committed (checked above).
    assert set(ledger.errors) <= {"Unavailable"}


# ------------------------------------------------------------------------------- redis


@pytest.mark.slow
async def test_redis_stopped_for_seconds_circuit_opens_and_closes(
    fresh_redis: RedisServer, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Redis SIGSTOPped for 3 s under load: one timeout opens the circuit, saves go on
    through the database, and the circuit closes by itself after SIGCONT."""
    ledger = Ledger()
    options: dict[str, Any] = {
        "redis_timeout_s": 0.5,
        "breaker_cooldown_s": 0.5,
        "lease_ms": 1000,
        "local_cache_size": 0,
    }
    async with (
        Gateway(fresh_redis.url, pg_url, **options) as gw,
        loaded([gw], ledger, both=False) as load,
    ):
        await load.grows_by(300, "saves before the fault")
        fresh_redis.pause()
        try:
            opened_s = await until("the circuit to open", lambda: gw.degraded)
            before = ledger.acknowledged
            await asyncio.sleep(3.0)
            assert gw.degraded
            during = ledger.acknowledged - before
        finally:
            fresh_redis.resume()
        closed_s = await until("the circuit to close", lambda: not gw.degraded)
        batches = gw.stats().claim_batches
        await load.grows_by(300, "saves after the fault")
        assert gw.stats().claim_batches > batches  # claims go to Redis again
        stats = gw.stats()
    await check_contract(
        capsys, "Redis SIGSTOPped 3 s", pg_url, ledger,
        acked_while_degraded=during, opened_after_s=round(opened_s, 2),
        closed_after_sigcont_s=round(closed_s, 2), breaker_opens=stats.breaker_opens,
        degraded_answers=stats.degraded_answers,
    )  # fmt: skip
    assert during > 0 and stats.degraded_answers > 0 and stats.breaker_opens >= 1
    assert set(ledger.errors) <= {"Unavailable"}
    # Values saved while degraded have no marker: a later claim wins, the insert
    # conflicts (db, created=False), and the marker is set.
    sources = await resave_after(capsys, fresh_redis.url, pg_url, ledger, "Redis SIGSTOPped")
    assert sources["db"] >= 1


@pytest.mark.slow
async def test_redis_killed_then_restarted_empty(
    fresh_redis: RedisServer, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Redis SIGKILLed under load and kept down 2 s, then restarted empty: connection
    errors open the circuit, saves go on through the database, the circuit closes."""
    ledger = Ledger()
    options: dict[str, Any] = {"redis_timeout_s": 0.5, "breaker_cooldown_s": 0.5, "lease_ms": 1000}
    async with (
        Gateway(fresh_redis.url, pg_url, **options) as gw,
        loaded([gw], ledger, both=False) as load,
    ):
        await load.grows_by(300, "saves before the fault")
        fresh_redis.kill()
        opened_s = await until("the circuit to open", lambda: gw.degraded)
        await load.grows_by(300, "saves while Redis is down")
        await asyncio.sleep(2.0)
        await asyncio.to_thread(fresh_redis.restart)
        closed_s = await until("the circuit to close", lambda: not gw.degraded)
        await load.grows_by(300, "saves after the restart")
        stats = gw.stats()
    await check_contract(
        capsys, "Redis SIGKILLed, restarted empty", pg_url, ledger,
        opened_after_s=round(opened_s, 2), closed_after_restart_s=round(closed_s, 2),
        degraded_answers=stats.degraded_answers,
    )  # fmt: skip
    assert stats.degraded_answers > 0
    # Until the circuit opened, a few saves failed with a typed error; nothing else did.
    assert set(ledger.errors) <= {"Unavailable"}
    # Every marker from before the kill is gone; the database still knows every value.
    sources = await resave_after(capsys, fresh_redis.url, pg_url, ledger, "Redis restarted")
    assert sources["db"] >= 1


@pytest.mark.slow
async def test_slow_redis_one_gateway_degraded_the_other_not(
    redis_server: RedisServer, redis_url: str, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replies delayed past redis_timeout_s for one gateway only (a proxy): it opens its
    circuit and writes through the database while the other still claims in Redis, both
    saving the same values at the same moments; it recovers when the delay goes."""
    ledger = Ledger()
    target = urlsplit(redis_url)
    assert target.hostname is not None and target.port is not None
    async with SlowProxy(target.hostname, target.port) as proxy:
        slow_options: dict[str, Any] = {
            "redis_timeout_s": 0.3,
            "breaker_cooldown_s": 0.5,
            "lease_ms": 1000,
            "local_cache_size": 0,
        }
        async with (
            Gateway(proxy.url, pg_url, **slow_options) as slow,
            Gateway(redis_url, pg_url, lease_ms=1000, wait_timeout_s=WAIT_S, local_cache_size=0)
            as direct,
            loaded([slow, direct], ledger, both=True) as load,
        ):  # fmt: skip
            await load.grows_by(300, "saves before the delay")
            proxy.delay_s = 1.0
            opened_s = await until("the slow gateway's circuit to open", lambda: slow.degraded)
            assert not direct.degraded
            await asyncio.sleep(1.5)
            degraded_now = slow.stats().degraded_answers
            await load.grows_by(300, "saves while one gateway is degraded")
            assert slow.degraded and slow.stats().degraded_answers > degraded_now
            proxy.delay_s = 0.0
            closed_s = await until("the slow gateway's circuit to close", lambda: not slow.degraded)
            batches = slow.stats().claim_batches
            await load.grows_by(300, "saves after the delay")
            assert slow.stats().claim_batches > batches
            slow_stats, direct_stats = slow.stats(), direct.stats()
    await check_contract(
        capsys, "slow Redis for one of two gateways", pg_url, ledger,
        opened_after_s=round(opened_s, 2), closed_after_s=round(closed_s, 2),
        slow_degraded_answers=slow_stats.degraded_answers, slow_writes=slow_stats.write,
        direct_writes=direct_stats.write, direct_busy=direct_stats.busy,
    )  # fmt: skip
    assert direct_stats.degraded_answers == 0 and direct_stats.breaker_opens == 0
    assert set(ledger.errors) <= {"Unavailable"}
    # Both gateways created rows, yet never the same one twice (checked above).
    assert slow_stats.write > 0 and direct_stats.write > 0


async def test_calls_that_outnumber_the_pool_wait_for_a_connection(
    fresh_redis: RedisServer, pg_url: str
) -> None:
    """Redis stalls for 0.6 s, well inside redis_timeout_s (2 s): the claim batches in
    flight hold their connections, and readiness pings (a /readyz each) come on top, more
    calls than the pool's connections. They wait for a connection; none is refused and
    counted as Redis being down, so the circuit stays closed and every save succeeds."""
    async with Gateway(fresh_redis.url, pg_url, shared_writes="off") as gw:
        assert (await gw.save("email", "warm")).created
        fresh_redis.pause()
        try:
            saves = [asyncio.ensure_future(gw.save("email", f"v{i}")) for i in range(3000)]
            await asyncio.sleep(0.05)
            pings = [asyncio.ensure_future(gw.ping(timeout_s=1.5)) for _ in range(12)]
            await asyncio.sleep(0.6)
        finally:
            fresh_redis.resume()
        answers = await asyncio.wait_for(asyncio.gather(*pings), WAIT_S)
        results = await asyncio.wait_for(asyncio.gather(*saves), WAIT_S)
        stats = gw.stats()
        assert not gw.degraded and stats.breaker_opens == 0 and stats.redis_errors == 0
    assert all(answer["redis"] for answer in answers)
    assert all(r.created for r in results)


async def test_redis_slower_than_the_lease_allows_still_ends_each_wait(
    redis_url: str, pg_url: str
) -> None:
    """Claims that come back later than the lease leaves room for a statement (100 ms
    lease, 50 ms statement bound and 10 ms margin: a winner writes within 40 ms of its
    claim; Redis answers in 60 ms): no winner can write, so each is claimed again to
    renew its lease, and the caller gets WaitTimeout by wait_timeout_s rather than
    waiting while that goes round for ever. Faster answers, and the same value saves."""
    target = urlsplit(redis_url)
    assert target.hostname is not None and target.port is not None
    async with (
        SlowProxy(target.hostname, target.port) as proxy,
        Gateway(proxy.url, pg_url, lease_ms=100, wait_timeout_s=1.0) as gw,
    ):
        proxy.delay_s = 0.06
        started = time.monotonic()
        with pytest.raises(WaitTimeout):
            await asyncio.wait_for(gw.save("email", "slow@example.com"), WAIT_S)
        waited = time.monotonic() - started
        stats = gw.stats()
        assert stats.wait_timeouts == 1 and stats.reclaims > 0 and stats.write == 0
        assert not gw.degraded  # slow, not failing: the circuit stays closed
        proxy.delay_s = 0.0
        result = await asyncio.wait_for(gw.save("email", "slow@example.com"), WAIT_S)
    assert result.created
    assert waited < WAIT_S / 2  # ended by its own bound, not by this test's
    assert await table(pg_url) == {("email", "slow@example.com")}


# -------------------------------------------------------------------------------- database


@pytest.mark.slow
async def test_postgres_restarted_under_load(
    redis_url: str, fresh_pg: PostgresCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """PostgreSQL SIGKILLed under load and started again: saves fail with a typed error
    meanwhile (nothing acknowledged), and the same gateway serves again by itself."""
    url = fresh_pg.create_database("app")
    await upgrade_async(url)
    ledger = Ledger()
    async with (
        Gateway(redis_url, url, lease_ms=2000) as gw,
        loaded([gw], ledger, both=False) as load,
    ):
        await load.grows_by(300, "saves before the crash")
        fresh_pg.kill()
        errors_before = sum(ledger.errors.values())
        await until("saves to fail", lambda: sum(ledger.errors.values()) > errors_before)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(fresh_pg.start)
        recovered_s = await load_recovers(load)
        stats = gw.stats()
    await check_contract(
        capsys, "PostgreSQL SIGKILLed and restarted", url, ledger,
        recovered_after_start_s=round(recovered_s, 2), db_errors=stats.db_errors,
    )  # fmt: skip
    assert set(ledger.errors) == {"Unavailable"}
    assert not stats.breaker_opens  # a database outage is not a Redis outage
    assert await leases_held(redis_url) == 0  # failed writes released their leases


async def test_redis_and_database_both_down(
    fresh_redis: RedisServer, fresh_pg: PostgresCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """Degraded (Redis stopped) and the database killed too: a typed database error and
    nothing acknowledged; the degraded writes succeed once it is back, and normal mode
    returns after Redis does."""
    url = fresh_pg.create_database("app")
    await upgrade_async(url)
    ledger = Ledger()
    options: dict[str, Any] = {"redis_timeout_s": 0.3, "breaker_cooldown_s": 0.3}
    async with Gateway(fresh_redis.url, url, **options) as gw:
        ledger.record(("email", "before"), await gw.save("email", "before"))
        fresh_redis.pause()
        try:
            fresh_pg.kill()
            with pytest.raises(Unavailable) as caught:
                await gw.save("email", "during")
            assert caught.value.component == "database" and gw.degraded
            ledger.errors["Unavailable"] += 1
            await asyncio.to_thread(fresh_pg.start)
            deadline = time.monotonic() + WAIT_S
            while True:  # the pool reconnects by itself
                try:
                    result = await gw.save("email", "during")
                    break
                except Unavailable:
                    ledger.errors["Unavailable"] += 1
                    assert time.monotonic() < deadline, "the database never came back"
                    await asyncio.sleep(0.1)
            assert gw.degraded and (result.created, result.source) == (True, "write")
            ledger.record(("email", "during"), result)
        finally:
            fresh_redis.resume()
        await until("the circuit to close", lambda: not gw.degraded)
        ledger.record(("email", "after"), await gw.save("email", "after"))
        assert gw.stats().claim_batches >= 2  # "after" was claimed in Redis again
    rows = await check_contract(capsys, "Redis stopped and PostgreSQL killed", url, ledger)
    assert rows == {("email", "before"), ("email", "during"), ("email", "after")}


async def load_recovers(load: Load) -> float:
    """Seconds until 300 more saves are acknowledged."""
    started = time.monotonic()
    await load.grows_by(300, "saves after the restart")
    return time.monotonic() - started


# ---------------------------------------------------------------------- admission control


def slow_pg_sink(pool: asyncpg.Pool, sleep_s: float, counts: dict[str, int]) -> Any:
    """A batch writer on dedup_items whose every statement takes ``sleep_s`` longer (a
    real ``pg_sleep`` in the inserting transaction): a database under strain."""

    async def write(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        counts["running"] += 1
        counts["peak"] = max(counts["peak"], counts["running"])
        counts["statements"] += 1
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_sleep($1)", sleep_s)
                return await pg_insert(conn, rows)
        finally:
            counts["running"] -= 1

    return write


async def test_degraded_admission_control(
    fresh_redis: RedisServer, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Degraded, with a slow database: at most degraded_max_statements statements at
    once; past the queue bound or the queue deadline a save is Overloaded, and nothing
    refused reaches the table."""
    counts = {"running": 0, "peak": 0, "statements": 0}
    pool = await asyncpg.create_pool(pg_url, min_size=1, max_size=8)
    try:
        sink = slow_pg_sink(pool, 0.3, counts)
        async with Gateway(
            fresh_redis.url,
            sink=sink,
            redis_timeout_s=0.3,
            breaker_cooldown_s=60.0,  # stays degraded for the whole test
            max_batch=20,
            write_timeout_ms=2000,
            degraded_max_statements=2,
            degraded_max_queue=100,
            degraded_queue_timeout_s=0.5,
        ) as gw:
            assert (await gw.save("email", "warm")).created
            counts["statements"] = counts["peak"] = 0
            fresh_redis.pause()
            keys = [("email", f"a{i}") for i in range(300)]
            outcomes = await asyncio.gather(*(gw.save(*k) for k in keys), return_exceptions=True)
            assert gw.degraded
            stats = gw.stats()
    finally:
        await pool.close()
        fresh_redis.resume()
    ledger = Ledger()
    refused: dict[str, set[Key]] = {"full": set(), "late": set()}
    for key, outcome in zip(keys, outcomes, strict=True):
        if isinstance(outcome, Overloaded):
            refused["full" if "full" in str(outcome) else "late"].add(key)
            ledger.errors["Overloaded"] += 1
        else:
            assert isinstance(outcome, SaveResult), outcome
            ledger.record(key, outcome)
    rows = await check_contract(
        capsys, "degraded admission control", pg_url, ledger,
        peak_statements=counts["peak"], statements=counts["statements"],
        refused_queue_full=len(refused["full"]), refused_deadline=len(refused["late"]),
    )  # fmt: skip
    assert counts["peak"] == 2  # the bound is used, never exceeded
    # 300 values: 100 fit the queue and two statements of 20 rows take more.
    assert len(refused["full"]) >= 300 - 100 - 2 * 20
    assert refused["late"]  # two statements of 20 rows per 0.3 s cannot drain 100 in 0.5 s
    assert not (refused["full"] | refused["late"]) & rows  # refused means never written
    assert stats.overloaded == len(refused["full"]) + len(refused["late"])
    assert rows == {("email", "warm")} | set(ledger.acks)


# ------------------------------------------------------------------------------ service


async def test_service_readyz_and_metrics_show_degraded(
    fresh_redis: RedisServer, pg_url: str, tmp_path: Path
) -> None:
    """/readyz stays 200 with "degraded": true while Redis is stopped (the database
    answers), and says why ("reason": "unreachable"); /metrics dedup_degraded and
    dedup_degraded_reason follow; both return to normal after SIGCONT."""
    env = service_env(
        fresh_redis.url,
        pg_url,
        DEDUP_REDIS_TIMEOUT_S="0.3",
        DEDUP_BREAKER_COOLDOWN_S="0.3",
        DEDUP_READY_TIMEOUT_S="0.3",
    )
    svc = spawn_service(tmp_path, env)
    try:
        await wait_healthy(svc)
        async with aiohttp.ClientSession(
            base_url=svc.url, timeout=aiohttp.ClientTimeout(total=WAIT_S)
        ) as http:

            async def metric(name: str) -> float:
                async with http.get("/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith(name + " "):
                            return float(line.split()[1])
                raise AssertionError(f"{name} not in /metrics")

            unreachable = 'dedup_degraded_reason{reason="unreachable"}'
            status, body, _ = await request(http, "GET", "/readyz")
            assert (status, body["degraded"]) == (200, False)
            assert "reason" not in body
            assert await metric("dedup_degraded") == 0
            assert await metric(unreachable) == 0
            fresh_redis.pause()
            try:
                status, body, _ = await request(
                    http, "POST", "/v1/save", json={"kind": "d", "value": "while-stopped"}
                )
                assert (status, body) == (201, {"created": True, "source": "write"})
                status, body, _ = await request(http, "GET", "/readyz")
                assert (status, body) == (
                    200,
                    {
                        "ready": True,
                        "degraded": True,
                        "checks": {"redis": False, "database": True},
                        "reason": "unreachable",  # stopped: it does not answer at all
                    },
                )
                assert await metric("dedup_degraded") == 1
                assert await metric(unreachable) == 1
                assert await metric("dedup_breaker_opens_total") == 1
                assert await metric("dedup_degraded_answers_total") == 1
            finally:
                fresh_redis.resume()

            async def normal() -> bool:
                status, body, _ = await request(http, "GET", "/readyz")
                return status == 200 and body["degraded"] is False

            deadline = time.monotonic() + WAIT_S
            while not await normal():
                assert time.monotonic() < deadline, "the circuit never closed"
                await asyncio.sleep(0.05)
            assert await metric("dedup_degraded") == 0
            assert await metric(unreachable) == 0
            status, body, _ = await request(http, "GET", "/readyz")
            assert "reason" not in body
            status, body, _ = await request(
                http, "POST", "/v1/save", json={"kind": "d", "value": "while-stopped"}
            )
            assert (status, body["created"]) == (200, False)
        svc.terminate()
        assert await wait_exit(svc) == 0
    finally:
        with contextlib.suppress(Exception):
            fresh_redis.resume()
        if svc.proc.poll() is None:
            svc.kill()
