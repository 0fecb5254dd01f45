"""Gateway.once and Gateway.get against real redis-server and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import redis as sync_redis

from dedup import DedupError, Gateway, InvalidInput, Row, Unavailable, WaitTimeout
from tests.embed_child import EmbedChild
from tests.servers import RedisServer

DEADLINE_S = 120.0


@pytest.fixture
async def gw(redis_url: str, pg_url: str) -> AsyncIterator[Gateway]:
    async with Gateway(redis_url, pg_url) as gateway:
        yield gateway


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], EmbedChild]]:
    started: list[EmbedChild] = []

    def start(job: dict[str, Any]) -> EmbedChild:
        child = EmbedChild(job, tmp_path / f"child-{len(started)}")
        started.append(child)
        return child

    try:
        yield start
    finally:
        for child in started:
            child.kill()


async def test_runs_once_and_every_caller_gets_the_stored_value(
    gw: Gateway, redis_url: str, pg_url: str
) -> None:
    runs: list[str] = []

    @gw.once("welcome-mail")
    async def send(address: str, template: str = "hello") -> dict[str, Any]:
        runs.append(address)
        await asyncio.sleep(0.05)  # callers pile up while it runs
        return {"to": address, "template": template, "ids": (1, 2)}

    results = await asyncio.gather(*(send("a@example.com") for _ in range(20)))
    assert runs == ["a@example.com"]
    expected = {"to": "a@example.com", "template": "hello", "ids": [1, 2]}  # as JSON gives it
    assert results == [expected] * 20
    assert await send("a@example.com", template="other") == expected  # later: no run
    assert runs == ["a@example.com"]
    assert await gw.get("welcome-mail", "a@example.com") == expected
    assert await gw.get("welcome-mail", "b@example.com") is None
    assert send.__name__ == "send"  # functools.wraps
    # A second Gateway (another process, as far as Redis can tell) gets it too.
    async with Gateway(redis_url, pg_url) as other:
        twin = other.once("welcome-mail")(send.__wrapped__)  # type: ignore[attr-defined]
        assert await twin("a@example.com") == expected
    assert runs == ["a@example.com"]


async def test_a_raising_function_saves_nothing_and_runs_again(gw: Gateway) -> None:
    attempts = 0

    @gw.once("charge", key=lambda order_id, amount: order_id)
    async def charge(order_id: str, amount: int) -> dict[str, int]:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("payment provider down")
        return {"charged": amount}

    with pytest.raises(RuntimeError, match="provider down"):
        await charge("order-1", 10)
    assert await gw.get("charge", "order-1") is None
    assert await gw.count_rows(["charge"]) == 0
    assert await charge("order-1", 10) == {"charged": 10}
    assert await charge("order-1", 99) == {"charged": 10}
    assert attempts == 2


async def test_waiters_of_a_failed_run_run_it_themselves(gw: Gateway) -> None:
    attempts = 0

    @gw.once("job")
    async def flaky(value: str) -> int:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(0.05)
        if attempts == 1:
            raise RuntimeError("first run fails")
        return attempts

    results = await asyncio.gather(*(flaky("v") for _ in range(5)), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert len(failures) == 1 and isinstance(failures[0], RuntimeError)
    assert [r for r in results if not isinstance(r, BaseException)] == [2] * 4
    assert attempts == 2


async def test_a_value_saved_by_plain_save_does_not_run(gw: Gateway) -> None:
    assert (await gw.save("mail", "plain@example.com")).created
    assert (await gw.save("mail", "with-payload@example.com", {"old": True})).created

    @gw.once("mail")
    async def send(address: str) -> str:
        raise AssertionError("must not run")

    assert await send("plain@example.com") is None
    assert await send("with-payload@example.com") == {"old": True}


async def test_a_save_during_a_run_in_the_same_process_waits_for_the_run(gw: Gateway) -> None:
    """A plain save of a value that a run-once call of the same Gateway is running waits
    for that run, as a save in another process does: it does not take the run's lease
    as its own, write the row without the run's result and end the run's lease."""
    started, finish = asyncio.Event(), asyncio.Event()

    @gw.once("mail")
    async def send(address: str) -> dict[str, str]:
        started.set()
        await finish.wait()
        return {"sent": address}

    run = asyncio.ensure_future(send("during@example.com"))
    await asyncio.wait_for(started.wait(), DEADLINE_S)
    save = asyncio.create_task(gw.save("mail", "during@example.com"))
    await asyncio.sleep(0.5)
    assert not save.done()  # waiting for the run (it would have written in ~ms)
    finish.set()
    assert await asyncio.wait_for(run, DEADLINE_S) == {"sent": "during@example.com"}
    result = await asyncio.wait_for(save, DEADLINE_S)
    assert not result.created
    assert await gw.get("mail", "during@example.com") == {"sent": "during@example.com"}
    assert await gw.count_rows(["mail"]) == 1


async def test_a_row_without_a_marker_is_found_in_the_database(redis_url: str, pg_url: str) -> None:
    async with Gateway(redis_url, pg_url) as first:
        assert (await first.save("mail", "x@example.com", "stored")).created
    client = sync_redis.Redis.from_url(redis_url)  # Redis loses the marker
    client.flushall()
    client.close()
    async with Gateway(redis_url, pg_url) as gw:

        @gw.once("mail")
        async def send(address: str) -> str:
            raise AssertionError("must not run: the row exists")

        assert await send("x@example.com") == "stored"


async def forget(pg_url: str, kind: str) -> None:
    """What docs/embedding.md once advised to forget keys: delete the rows of ``kind``,
    and only them (the Redis markers stay). Also used by test_middleware."""
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("DELETE FROM dedup_items WHERE kind = $1", kind)
    finally:
        await conn.close()


# The three ways Redis records "saved": a hash field, the lease key's "1", Bloom bits.
_LAYOUTS: dict[str, dict[str, Any]] = {
    "compact": {},
    "keys": {"marker_layout": "keys"},
    "approximate": {"approximate_values": 10_000},
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
async def test_a_value_whose_row_was_deleted_runs_again(
    redis_url: str, pg_url: str, layout: str
) -> None:
    """A value forgotten by deleting its row, while Redis (markers kept forever by
    default) and the local tier still say "saved", is run again: never answered with a
    made-up payload for a row that does not exist."""
    options: dict[str, Any] = {**_LAYOUTS[layout], "lease_ms": 300}
    runs: list[str] = []

    async def send(address: str) -> dict[str, int]:
        runs.append(address)
        await asyncio.sleep(1.0)  # three leases long: only renewals keep it
        return {"run": len(runs)}

    async with Gateway(redis_url, pg_url, **options) as gw:
        once = gw.once("mail")(send)
        assert await once("a@example.com") == {"run": 1}
        await forget(pg_url, "mail")
        # The local tier of this Gateway, and Redis, still say saved.
        assert await once("a@example.com") == {"run": 2}
        assert await once("a@example.com") == {"run": 2}  # saved again: no run
        assert await gw.get("mail", "a@example.com") == {"run": 2}
        await forget(pg_url, "mail")
    # Fresh Gateways (other processes: no local tier), only the Redis marker says saved.
    # Concurrent callers in two of them: one reclaims the value and runs it, renewing its
    # lease past three leases, the others wait for its outcome.
    async with (
        Gateway(redis_url, pg_url, **options) as one,
        Gateway(redis_url, pg_url, **options) as two,
    ):
        calls = [g.once("mail")(send)("a@example.com") for g in (one, two) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*calls), DEADLINE_S)
        assert results == [{"run": 3}] * 6
        assert await two.get("mail", "a@example.com") == {"run": 3}
    assert runs == ["a@example.com"] * 3


async def test_bad_input_and_results_are_typed(gw: Gateway) -> None:
    @gw.once("job")
    async def not_json(value: str) -> object:
        return object()

    with pytest.raises(InvalidInput, match="JSON"):
        await not_json("v")
    assert await gw.count_rows(["job"]) == 0  # nothing saved: the next call runs again

    @gw.once("job")
    async def ok(value: str) -> int:
        return 1

    assert await ok("v") == 1
    with pytest.raises(InvalidInput):
        await ok(7)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        await ok()  # type: ignore[call-arg]
    with pytest.raises(InvalidInput):
        gw.once("")
    with pytest.raises(InvalidInput):
        gw.once("job")(lambda v: v)
    with pytest.raises(InvalidInput):
        await gw.get("job", "x" * 10_000)


async def test_a_closed_gateway_and_a_custom_sink_refuse(redis_url: str, pg_url: str) -> None:
    gw = Gateway(redis_url, pg_url)

    @gw.once("job")
    async def work(value: str) -> int:
        return 1

    with pytest.raises(DedupError, match="not open"):
        await work("v")

    async def sink(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        return [(r.kind, r.digest) for r in rows]

    async with Gateway(redis_url, sink=sink, namespace=f"t-{uuid.uuid4().hex[:8]}") as custom:
        with pytest.raises(DedupError, match="default sink"):
            await custom.once("job")(work.__wrapped__)("v")  # type: ignore[attr-defined]
        with pytest.raises(DedupError, match="default sink"):
            await custom.get("job", "v")


async def test_waiters_are_bounded_by_wait_timeout(redis_url: str, pg_url: str) -> None:
    release = asyncio.Event()
    started = asyncio.Event()
    async with (
        Gateway(redis_url, pg_url, lease_ms=500) as runner_gw,
        Gateway(redis_url, pg_url, wait_timeout_s=0.3) as waiter_gw,
    ):

        async def slow(value: str) -> str:
            started.set()
            await release.wait()
            return "done"

        runner = asyncio.ensure_future(runner_gw.once("job")(slow)("v"))
        await asyncio.wait_for(started.wait(), DEADLINE_S)
        with pytest.raises(WaitTimeout):
            await waiter_gw.once("job")(slow)("v")
        release.set()
        assert await asyncio.wait_for(runner, DEADLINE_S) == "done"
        assert await waiter_gw.once("job")(slow)("v") == "done"


async def test_the_lease_is_renewed_while_the_function_runs(redis_url: str, pg_url: str) -> None:
    runs = 0
    # A lease of 1 s with database statements bounded by 0.8 s (the most it allows): a
    # lease of 0.3 s bounded them by 0.15 s, which a loaded machine's reads overran.
    async with (
        Gateway(redis_url, pg_url, lease_ms=1000, write_timeout_ms=800) as runner_gw,
        Gateway(redis_url, pg_url, lease_ms=1000, write_timeout_ms=800) as other_gw,
    ):

        async def long(value: str) -> int:
            nonlocal runs
            runs += 1
            await asyncio.sleep(3.0)  # three leases long: only renewals keep it
            return runs

        first = asyncio.ensure_future(runner_gw.once("job")(long)("v"))
        async with asyncio.timeout(DEADLINE_S):
            while runs == 0:
                await asyncio.sleep(0.01)
        # Another process asks all along: it waits, and never takes the value over.
        second = await asyncio.wait_for(other_gw.once("job")(long)("v"), DEADLINE_S)
        assert (await asyncio.wait_for(first, DEADLINE_S), second, runs) == (1, 1, 1)


async def test_degraded_gateway_refuses_rather_than_run_twice(
    fresh_redis: RedisServer, pg_url: str
) -> None:
    async with Gateway(
        fresh_redis.url, pg_url, redis_timeout_s=0.3, breaker_cooldown_s=3600.0
    ) as gw:

        @gw.once("job")
        async def work(value: str) -> int:
            return 1

        fresh_redis.pause()
        try:
            with contextlib.suppress(DedupError):  # times out: the circuit opens
                await gw.save("trip", "the-breaker")
            assert gw.degraded
            with pytest.raises(Unavailable) as info:
                await work("v")
            assert info.value.component == "redis"
        finally:
            fresh_redis.resume()


def _run_children(
    children: Callable[[dict[str, Any]], EmbedChild], jobs: list[dict[str, Any]]
) -> None:
    procs = [children(job) for job in jobs]
    for child in procs:
        child.expect("READY")
    for child in procs:
        child.send("go\n")
    for child in procs:
        child.expect("DONE", timeout=DEADLINE_S)


def test_once_across_two_processes(
    redis_url: str, pg_url: str, tmp_path: Path, children: Callable[[dict[str, Any]], EmbedChild]
) -> None:
    values = [f"order-{i}" for i in range(200)]
    effects = tmp_path / "effects.txt"
    jobs: list[dict[str, Any]] = [
        {
            "mode": "once",
            "name": f"p{n}",
            "redis_url": redis_url,
            "database_url": pg_url,
            "options": {"local_cache_size": 0},
            "values": values * 3,
            "concurrency": 16,
            "effects": str(effects),
            "out": str(tmp_path / f"out-{n}.jsonl"),
        }
        for n in range(2)
    ]
    _run_children(children, jobs)
    ran = Counter(line.split()[0] for line in effects.read_text().splitlines())
    assert ran == Counter(values)  # each value's side effect ran exactly once
    answers: dict[str, list[Any]] = {}
    for job in jobs:
        for line in Path(job["out"]).read_text().splitlines():
            answer = json.loads(line)
            assert "error" not in answer, answer
            answers.setdefault(answer["value"], []).append(answer["result"])
    assert sorted(answers) == sorted(values)
    for value, results in answers.items():
        assert len(results) == 6
        assert all(r == results[0] for r in results)  # every caller: the same value
        assert results[0]["value"] == value


async def test_a_killed_runner_is_taken_over_after_its_lease(
    redis_url: str, pg_url: str, tmp_path: Path, children: Callable[[dict[str, Any]], EmbedChild]
) -> None:
    effects = tmp_path / "effects.txt"
    child = children(
        {
            "mode": "once_hold",
            "name": "killed",
            "redis_url": redis_url,
            "database_url": pg_url,
            "options": {"lease_ms": 400},
            "value": "order-1",
            "effects": str(effects),
        }
    )
    await asyncio.to_thread(child.expect, "RUNNING")
    child.kill()  # SIGKILL mid-function: the side effect ran, the commit never did
    async with Gateway(redis_url, pg_url, lease_ms=400) as gw:

        @gw.once("job")
        async def work(value: str) -> dict[str, str]:
            with effects.open("a") as f:
                f.write(f"{value} survivor\n")
            return {"value": value, "runner": "survivor"}

        result = await asyncio.wait_for(work("order-1"), DEADLINE_S)
        assert result == {"value": "order-1", "runner": "survivor"}
        assert await gw.get("job", "order-1") == result
    # "once" cannot promise more: the killed runner's side effect happened too.
    assert effects.read_text().splitlines() == ["order-1 killed", "order-1 survivor"]


async def test_once_beside_a_full_load_of_saves(gw: Gateway) -> None:
    """The run-once calls share the Gateway's Redis pool with its own stages."""

    @gw.once("job")
    async def work(value: str) -> str:
        return value.upper()

    async def saver(n: int) -> None:
        for i in range(100):
            await gw.save("load", f"{n}-{i}")

    async def runner(n: int) -> list[Any]:
        return [await work(f"v{i % 20}") for i in range(n, n + 40)]

    async with asyncio.timeout(DEADLINE_S):
        _, ran = await asyncio.gather(
            asyncio.gather(*(saver(n) for n in range(64))),
            asyncio.gather(*(runner(n) for n in range(16))),
        )
    assert all(isinstance(r, str) and r.startswith("V") for results in ran for r in results)
    assert await gw.count_rows(["load", "job"]) == 64 * 100 + 20


def _count_reads(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap the Gateway's sink so that each multi-row read is counted: the sizes of the
    statements' key lists, one entry a statement."""
    sink = gw._parts().default_sink
    assert sink is not None
    reads: list[int] = []
    fetch_many = sink.fetch_many

    async def counted(keys: Sequence[tuple[str, bytes]]) -> dict[tuple[str, bytes], str | None]:
        reads.append(len(keys))
        return await fetch_many(keys)

    monkeypatch.setattr(sink, "fetch_many", counted)
    return reads


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
async def test_concurrent_runs_share_their_reads_and_writes(
    redis_url: str, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, database: str
) -> None:
    """N concurrent runs of new values read their rows and write them in a few statements,
    not 2N; each runs once, and a value whose row exists (no marker) among them is still
    answered from its row, not run."""
    url = pg_url if database == "postgresql" else f"sqlite:///{tmp_path / 'd.sqlite3'}"
    n = 64
    async with Gateway(redis_url, url, migrate=True) as first:
        assert (await first.save("job", "v0", "saved before")).created
    client = sync_redis.Redis.from_url(redis_url)  # v0: a row without a marker
    client.flushall()
    client.close()
    async with Gateway(redis_url, url) as gw:
        reads = _count_reads(gw, monkeypatch)
        runs: Counter[str] = Counter()

        @gw.once("job")
        async def work(value: str) -> str:
            runs[value] += 1
            return value.upper()

        before = gw.stats().db_statements
        values = [f"v{i}" for i in range(n)]
        async with asyncio.timeout(DEADLINE_S):
            results = await asyncio.gather(*(work(v) for v in values))
        assert results == ["saved before", *(v.upper() for v in values[1:])]
        assert runs == Counter(values[1:])
        assert sum(reads) == n and len(reads) < n // 4
        statements = gw.stats().db_statements - before
        assert 1 <= statements < n // 4
        assert gw.stats().db_rows_sent >= n - 1
        assert await gw.count_rows(["job"]) == n
        assert [await gw.get("job", v) for v in values] == results


async def test_two_rows_of_one_key_in_a_write_batch(gw: Gateway) -> None:
    """Two runs of one key whose rows meet in one statement (possible only after a lost
    lease): the first row is inserted, the other is told it was not, and gets its payload."""
    from dedup._engine.once import Lease, _state

    parts = gw._parts()
    state = _state(gw, parts)
    digest = b"\x01" * 16
    key = parts.keys.key("job", digest)
    loop = asyncio.get_running_loop()
    first, second = (
        Lease(parts, "job", "v", digest, key, state, loop.create_future()) for _ in range(2)
    )
    first._payload, second._payload = '"first"', '"second"'
    async with asyncio.timeout(DEADLINE_S):
        stored = await asyncio.gather(state.store(first), state.store(second))
        assert list(stored) == [None, '"first"']
        assert await state.fetch(("job", digest)) == (True, '"first"')
        assert await state.fetch(("job", b"\x02" * 16)) == (False, None)
