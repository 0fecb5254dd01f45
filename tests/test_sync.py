"""SyncGateway against real redis-server and PostgreSQL: threads, processes, fork, close."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dedup import DedupError, InvalidInput, Row, SyncGateway, WaitTimeout
from dedup._engine.once import Lease, Saved, begin
from tests.embed_child import EmbedChild

DEADLINE_S = 120.0
GIVE_BACK_S = 2.0  # how soon an abandoned call's lease must be claimable again


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


def test_save_get_stats_ping_in_a_with_block(redis_url: str, pg_url: str) -> None:
    with SyncGateway(redis_url, pg_url) as gw:
        first = gw.save("email", "a@example.com", {"src": "web"})
        assert (first.created, first.source) == (True, "write")
        assert gw.save("email", "a@example.com").source == "local"
        results = gw.save_many(iter([("email", "a@example.com"), ("email", "b@example.com")]))
        assert [r.created for r in results] == [False, True]
        assert gw.get("email", "a@example.com") == {"src": "web"}
        assert gw.get("email", "never-saved") is None
        assert gw.ping() == {"redis": True, "database": True}
        assert gw.stats().write == 2
        assert not gw.degraded
    with pytest.raises(DedupError, match="closed"):
        gw.save("email", "c@example.com")
    gw.close()  # twice is fine


def test_bad_input_is_typed(redis_url: str, pg_url: str) -> None:
    with SyncGateway(redis_url, pg_url) as gw:
        with pytest.raises(InvalidInput):
            gw.save("email", 42)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput) as info:
            gw.save_many([("email", "ok"), ("", "bad kind")])
        assert info.value.index == 1
        with pytest.raises(InvalidInput):
            gw.save_many("not items")  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            gw.once("job")(lambda value: None)(1)  # a value that is not a str

        async def coroutine_function(value: str) -> None: ...

        with pytest.raises(InvalidInput):
            gw.once("job")(coroutine_function)
    with pytest.raises(InvalidInput):
        SyncGateway(redis_url, pg_url, call_timeout_s=0)


def test_a_failed_open_raises_and_leaves_no_thread(redis_url: str, pg_url: str) -> None:
    before = threading.active_count()
    with pytest.raises(DedupError):  # port 1: nothing listens there
        SyncGateway(redis_url, pg_url.rsplit("@", 1)[0] + "@127.0.0.1:1/none")
    assert threading.active_count() == before


def test_call_timeout_cancels_the_call(redis_url: str) -> None:
    release = threading.Event()

    async def slow_sink(rows: Sequence[Row]) -> list[tuple[str, bytes]]:
        await asyncio.to_thread(release.wait, DEADLINE_S)
        return [(r.kind, r.digest) for r in rows]

    with SyncGateway(
        redis_url, sink=slow_sink, namespace=f"t-{uuid.uuid4().hex[:8]}", call_timeout_s=0.3
    ) as gw:
        try:
            with pytest.raises(WaitTimeout, match="did not finish"):
                gw.save("email", "slow")
        finally:
            release.set()


def _claim_again(gw: SyncGateway, value: str) -> float:
    """Claim ``value`` (kind "request") as soon as it is free, within GIVE_BACK_S; the
    seconds it took. The lease is given back at once."""
    started = time.monotonic()
    while True:
        try:
            claimed = gw._call(begin(gw.gateway, "request", value, wait_s=0.0))
        except WaitTimeout:  # still held (by the abandoned call's lease, until it is freed)
            if time.monotonic() - started > GIVE_BACK_S:
                raise AssertionError(
                    f"{value!r} was still held {GIVE_BACK_S} s after its call was abandoned"
                ) from None
            time.sleep(0.02)
            continue
        assert isinstance(claimed, Lease)
        gw._call(claimed.fail())
        return time.monotonic() - started


def test_a_lease_won_as_its_call_times_out_is_given_back(redis_url: str, pg_url: str) -> None:
    # lease_ms=600: a lease that were only left to expire would be free after 0.6 s;
    # the watchdog of a lost Lease renews it for ever, so the key stayed held.
    with SyncGateway(redis_url, pg_url, lease_ms=600) as gw:

        async def claim_then_busy() -> Saved | Lease:
            got = await begin(gw.gateway, "request", "k1", wait_s=0.0)
            # The loop thread is busy (GC, CPU contention) right as the claim returns:
            # the caller's 0.1 s pass and its cancellation arrives after the return.
            time.sleep(0.3)
            return got

        with pytest.raises(WaitTimeout, match="did not finish"):
            gw._call(claim_then_busy(), timeout_s=0.1)
        _claim_again(gw, "k1")

        async def watchdogs() -> list[str]:
            return [
                t.get_name() for t in asyncio.all_tasks() if t.get_name() == "dedup-once-watchdog"
            ]

        assert gw._call(watchdogs()) == []  # nothing renews a lease nobody holds


def test_a_lease_returned_despite_the_cancellation_is_given_back(
    redis_url: str, pg_url: str
) -> None:
    with SyncGateway(redis_url, pg_url, lease_ms=600) as gw:

        async def claim_then_outlive_cancel() -> Saved | Lease:
            got = await begin(gw.gateway, "request", "k2", wait_s=0.0)
            # Code that outlives a cancellation (a cleanup, a shield) still returns the lease.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(DEADLINE_S)
            return got

        with pytest.raises(WaitTimeout, match="did not finish"):
            gw._call(claim_then_outlive_cancel(), timeout_s=0.1)
        _claim_again(gw, "k2")


def test_a_call_abandoned_before_it_started_never_runs(redis_url: str, pg_url: str) -> None:
    ran: list[str] = []
    with SyncGateway(redis_url, pg_url) as gw:

        async def record() -> None:
            ran.append("ran")

        # The loop thread is busy past the caller's timeout before the call even starts.
        gw._loop.call_soon_threadsafe(time.sleep, 0.3)
        with pytest.raises(WaitTimeout, match="did not finish"):
            gw._call(record(), timeout_s=0.1)
        gw.stats()  # a later call runs after the abandoned one would have
        assert ran == []


def test_many_threads_one_created_per_value(redis_url: str, pg_url: str) -> None:
    values = [f"v{i}" for i in range(300)]
    created: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    with SyncGateway(redis_url, pg_url, local_cache_size=0) as gw:

        def worker() -> None:
            try:
                for value in values:
                    if gw.save("email", value).created:
                        with lock:
                            created.append(value)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert not errors
        assert sorted(created) == sorted(values)


def test_eight_threads_in_each_of_two_processes(
    redis_url: str, pg_url: str, tmp_path: Path, children: Callable[[dict[str, Any]], EmbedChild]
) -> None:
    values = [f"user-{i}@example.com" for i in range(400)]
    procs = []
    for n in range(2):
        job: dict[str, Any] = {
            "mode": "sync_save",
            "name": f"p{n}",
            "redis_url": redis_url,
            "database_url": pg_url,
            "options": {"local_cache_size": 0},
            "values": values,
            "threads": 8,
            "out": str(tmp_path / f"out-{n}.jsonl"),
        }
        procs.append((children(job), job))
    for child, _ in procs:
        child.expect("READY")
    for child, _ in procs:
        child.send("go\n")
    answers: list[dict[str, Any]] = []
    for child, job in procs:
        child.expect("DONE", timeout=DEADLINE_S)
        answers += [json.loads(line) for line in Path(job["out"]).read_text().splitlines()]
    assert len(answers) == 2 * 8 * len(values)
    assert [a for a in answers if "error" in a] == []
    created = [a["value"] for a in answers if a["created"]]
    assert sorted(created) == sorted(values)  # exactly one created=True per value
    assert all(a["source"] == "write" for a in answers if a["created"])


def test_once_runs_a_plain_function_once(redis_url: str, pg_url: str) -> None:
    calls: list[str] = []
    lock = threading.Lock()
    with SyncGateway(redis_url, pg_url) as gw:

        @gw.once("welcome-mail")
        def send(address: str) -> dict[str, Any]:
            with lock:
                calls.append(address)
            return {"sent_to": address, "thread": threading.current_thread().name}

        results: list[Any] = []

        def worker() -> None:
            for address in ("a@example.com", "b@example.com"):
                results.append(send(address))

        threads = [threading.Thread(target=worker, name=f"w{i}") for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert sorted(calls) == ["a@example.com", "b@example.com"]
        by_address: dict[str, list[Any]] = {}
        for r in results:
            by_address.setdefault(r["sent_to"], []).append(r)
        assert {a: len(rs) for a, rs in by_address.items()} == {
            "a@example.com": 8,
            "b@example.com": 8,
        }
        for rs in by_address.values():
            assert all(r == rs[0] for r in rs)  # every caller got the stored value
        assert gw.get("welcome-mail", "a@example.com") == by_address["a@example.com"][0]

        attempts: list[int] = []

        @gw.once("charge", key=lambda order, amount: order)
        def charge(order: str, amount: int) -> int:
            attempts.append(amount)
            if len(attempts) == 1:
                raise RuntimeError("card declined")
            return amount

        with pytest.raises(RuntimeError, match="declined"):
            charge("o-1", 10)
        assert charge("o-1", 20) == 20  # the failed run saved nothing: this one runs
        assert charge("o-1", 30) == 20  # saved: the stored value, no run
        assert attempts == [10, 20]


def test_closed_and_forked_child_get_a_clear_error(redis_url: str, pg_url: str) -> None:
    gw = SyncGateway(redis_url, pg_url)
    try:
        assert gw.save("email", "before-fork").created
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it saw through the pipe, then leave at once
            message = "no error"
            try:
                gw.save("email", "in-child")
            except DedupError as exc:
                message = str(exc)
            except BaseException as exc:
                message = f"wrong error {exc!r}"
            gw.close()  # only marks it closed in the child
            os.write(write_end, message.encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            readable, _, _ = select.select([pipe], [], [], DEADLINE_S)
            assert readable, "the forked child did not answer"
            message_seen = pipe.read().decode()  # the child wrote once and exited
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert "fork()" in message_seen and "open a new SyncGateway" in message_seen
        # The parent's gateway is untouched by the child.
        assert gw.save("email", "after-fork").created
    finally:
        gw.close()
    with pytest.raises(DedupError, match="closed"):
        gw.save("email", "after-close")
    with pytest.raises(DedupError, match="closed"), gw:
        pass
