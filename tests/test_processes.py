"""Several OS processes, each with its own Gateway, on one Redis and one PostgreSQL.

The children are ``python -m tests.child`` (see :mod:`tests.child`). Every wait on
a child is bounded, and every child is SIGKILLed (by its PID) and reaped in
``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import asyncpg
from redis.asyncio import Redis

from dedup import Gateway
from dedup._claims.keys import KeySpace
from dedup._claims.protocol import Claims
from dedup._values import digest
from dedup.metrics import Stats

ROOT = Path(__file__).resolve().parent.parent
LINE_TIMEOUT_S = 60.0  # generous: a child imports dedup and opens its Gateway in ~1 s
RUN_TIMEOUT_S = 120.0


class Child:
    """One ``python -m tests.child`` process; its stdout is read line by line by a thread."""

    def __init__(self, job: dict[str, Any], files: Path) -> None:
        job_path = files.with_suffix(".job.json")
        job_path.write_text(json.dumps(job))
        self.stderr_path = files.with_suffix(".stderr")
        self._stderr: IO[bytes] = self.stderr_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.child", str(job_path)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
            )
        except BaseException:
            self._stderr.close()
            raise
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        for line in stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # end of output

    def read_line(self, timeout: float = LINE_TIMEOUT_S) -> str:
        """The next line the child prints; fails (with its stderr) on exit or timeout."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child {self.pid} printed nothing for {timeout} s") from None
        if line is None:
            self.proc.wait(timeout=LINE_TIMEOUT_S)
            raise AssertionError(
                f"child {self.pid} exited with {self.proc.returncode}: {self.stderr()}"
            )
        return line

    def send(self, text: str) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(text)
        stdin.flush()

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGCONT (a test may have stopped it) then SIGKILL by PID, if still running;
        reap it and close its pipes."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=LINE_TIMEOUT_S)
        self._reader.join(timeout=LINE_TIMEOUT_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(BrokenPipeError):  # a dead child's unflushed stdin
                    stream.close()
        self._stderr.close()


def _namespace() -> str:
    return f"tp-{uuid.uuid4().hex[:12]}"


async def _table(pg_url: str) -> list[tuple[str, str]]:
    conn = await asyncpg.connect(pg_url)
    try:
        records = await conn.fetch("SELECT kind, value, digest FROM dedup_items")
    finally:
        await conn.close()
    for r in records:  # the key is the digest of the value
        assert bytes(r["digest"]) == digest(r["value"])
    return [(r["kind"], r["value"]) for r in records]


async def _namespace_keys(redis_url: str, namespace: str) -> dict[bytes, bytes | None]:
    """Every Redis key of ``namespace`` and its value (None for a key that is not a
    string: a marker bucket, or a key of the shared writes)."""
    client = Redis.from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=KeySpace(namespace).match_pattern)]
        values = await client.mget(keys) if keys else []
    finally:
        await client.aclose()
    return dict(zip(keys, values, strict=True))


def _shared_key(namespace: str, key: bytes) -> bool:
    """Whether ``key`` is one of the shared writes' keys (``<ns>:{w}:...``: the fleet's
    heartbeat set, the queue, the writer lease and its fence), not a value's."""
    return key.startswith(namespace.encode() + b":{w}:")


def _is_bucket(namespace: str, key: bytes) -> bool:
    """Whether ``key`` names a compact marker bucket of ``namespace`` (``<ns>:m:<index>``)."""
    head = namespace.encode() + b":m:"
    return key.startswith(head) and key[len(head) :].isdigit()


async def _value_keys(redis_url: str, namespace: str) -> dict[bytes, bytes | None]:
    """The keys of ``namespace`` that belong to values (leases, old-layout markers):
    :func:`_namespace_keys` without its marker buckets and shared-writes keys."""
    keys = await _namespace_keys(redis_url, namespace)
    state = f"{namespace}:{{dedup-state}}:".encode()  # the namespace's own (epoch, drainer)
    return {
        k: v
        for k, v in keys.items()
        if not _is_bucket(namespace, k)
        and not _shared_key(namespace, k)
        and not k.startswith(state)
    }


async def _marker_fields(redis_url: str, namespace: str) -> int:
    """How many "saved" markers the compact buckets of ``namespace`` hold (each one a
    field whose value is "1")."""
    client = Redis.from_url(redis_url)
    try:
        buckets = [
            k
            async for k in client.scan_iter(match=KeySpace(namespace).match_pattern)
            if _is_bucket(namespace, k)
        ]
        total = 0
        for bucket in buckets:
            values = await client.hvals(bucket)
            assert set(values) == {b"1"}, bucket
            total += len(values)
    finally:
        await client.aclose()
    return total


async def markers(redis_url: str, keys: Sequence[tuple[str, str]], namespace: str = "dedup") -> str:
    """What Redis holds for each key of ``namespace``, in any marker layout: one letter
    per key, ``S`` saved, ``L`` leased, ``-`` absent
    (:meth:`dedup._claims.protocol.Claims.states`)."""
    space = KeySpace(namespace)
    client = Redis.from_url(redis_url)
    try:
        claims = Claims(client, lease_ms=1, retention_ms=0, stats=Stats())
        return await claims.states([space.key(k, digest(v)) for k, v in keys])
    finally:
        await client.aclose()


def _keys_of(namespace: str, items: list[tuple[str, str]]) -> set[bytes]:
    space = KeySpace(namespace)
    return {space.key(kind, digest(value)) for kind, value in items}


async def test_processes_save_overlapping_values_exactly_once(
    redis_url: str, pg_url: str, tmp_path: Path, spawn: Any
) -> None:
    namespace = _namespace()
    distinct = [("email", f"user{i}@example.com") for i in range(1000)] + [
        ("phone", f"+1555{i:07d}") for i in range(1000)
    ]
    # Per process: a different batching and local tier (0 disables it), so the
    # processes race through every path (local, inflight, redis, db, write).
    setups = [
        {"local_cache_size": 100_000, "max_batch": 512},
        {"local_cache_size": 0, "max_batch": 64},
        {"local_cache_size": 128, "max_batch": 16},
        {"local_cache_size": 1000, "max_batch": 200},
    ]
    children: list[tuple[Child, Path, int]] = []
    for n, setup in enumerate(setups):
        rng = random.Random(n)
        items = distinct * 2 + rng.choices(distinct, k=500)  # every value, with duplicates
        rng.shuffle(items)
        out = tmp_path / f"answers-{n}.jsonl"
        job = {
            "mode": "save",
            "name": n,
            "redis_url": redis_url,
            "database_url": pg_url,
            "items": items,
            "concurrency": 64,
            "out": str(out),
            "options": {"namespace": namespace, "wait_timeout_s": 60.0, **setup},
        }
        children.append((spawn(job), out, len(items)))
    for child, _, _ in children:
        assert child.read_line() == "READY"
    for child, _, _ in children:
        child.send("go\n")  # all at once, so that they really race

    answers: list[dict[str, Any]] = []
    calls = 0
    child_stats: list[dict[str, int]] = []
    for child, out, n_items in children:
        child_stats.append(json.loads(child.read_line(RUN_TIMEOUT_S))["stats"])
        assert child.read_line() == "DONE"
        assert child.proc.wait(timeout=LINE_TIMEOUT_S) == 0, child.stderr()
        assert child.stderr() == ""
        answers += [json.loads(line) for line in out.read_text().splitlines()]
        calls += n_items

    errors = [a for a in answers if "error" in a]
    acknowledged = len(answers) - len(errors)
    created = Counter((a["kind"], a["value"]) for a in answers if a.get("created"))
    table = await _table(pg_url)
    lost = calls - len(answers)
    never_created = [item for item in distinct if created[item] == 0]
    print(
        f"\n{len(setups)} processes, {calls} calls, {len(distinct)} distinct values: "
        f"acknowledged={acknowledged} errors={len(errors)} lost={lost} "
        f"created={sum(created.values())} never_created={len(never_created)} rows={len(table)}"
    )
    sources = Counter(a["source"] for a in answers if "source" in a)
    print(f"answers by source: {dict(sorted(sources.items()))}")
    print(f"busy per process: {[s['busy'] for s in child_stats]}")

    assert errors == []
    assert lost == 0  # one answer per call
    for a in answers:
        assert a["created"] == (a["source"] == "write")
    # Exactly one created=True per value across all the processes, none for others.
    assert set(created) == set(distinct)
    assert set(created.values()) == {1}
    assert sum(s["write"] for s in child_stats) == len(distinct)
    # One row per distinct value, and the rows are exactly the values saved.
    assert len(table) == len(distinct)
    assert sorted(table) == sorted(distinct)
    # Redis holds one "saved" marker per value, all in this namespace: every value
    # reads saved, the buckets hold exactly one field per value, and no lease or other
    # per-value key is left behind.
    assert await markers(redis_url, distinct, namespace) == "S" * len(distinct)
    assert await _marker_fields(redis_url, namespace) == len(distinct)
    assert await _value_keys(redis_url, namespace) == {}

    # Namespaces are separate: this namespace answers from its markers, another
    # one has none and finds the rows in the database instead.
    sample = distinct[::50]
    async with Gateway(redis_url, pg_url, namespace=namespace) as gw:
        same = await gw.save_many(sample)
    other_namespace = _namespace()
    async with Gateway(redis_url, pg_url, namespace=other_namespace) as gw:
        other = await gw.save_many(sample)
    assert {(r.created, r.source) for r in same} == {(False, "redis")}
    assert {(r.created, r.source) for r in other} == {(False, "db")}
    assert await markers(redis_url, sample, other_namespace) == "S" * len(sample)
    assert await _marker_fields(redis_url, other_namespace) == len(sample)
    assert await _value_keys(redis_url, other_namespace) == {}
    assert await _marker_fields(redis_url, namespace) == len(distinct)
    assert len(await _table(pg_url)) == len(distinct)


async def test_sigkilled_lease_holder_is_taken_over_after_its_lease(
    redis_url: str, pg_url: str, spawn: Any
) -> None:
    namespace = _namespace()
    lease_ms = 3000
    items = [("email", f"held{i}@example.com") for i in range(300)]  # one claim batch
    holder = spawn(
        {
            "mode": "hold",
            "redis_url": redis_url,
            "items": items,
            "options": {"namespace": namespace, "lease_ms": lease_ms},
        }
    )
    assert holder.read_line() == f"HOLDING {len(items)}"  # its claim won every value

    # The leases are really held: one key per value, each a token (not the "saved"
    # marker "1") with an expiry, and no value reads saved. (Beside them the namespace
    # may hold the shared writes' heartbeat set, ``<ns>:{w}:fleet``.)
    keys = await _value_keys(redis_url, namespace)
    assert set(keys) == _keys_of(namespace, items)
    assert b"1" not in set(keys.values())
    assert await markers(redis_url, items, namespace) == "L" * len(items)
    assert await _marker_fields(redis_url, namespace) == 0
    client = Redis.from_url(redis_url)
    try:
        ttls = [await client.pttl(k) for k in list(keys)[:10]]
    finally:
        await client.aclose()
    assert all(0 < ttl <= lease_ms for ttl in ttls), ttls

    os.kill(holder.pid, signal.SIGKILL)  # no release, no goodbye
    assert holder.proc.wait(timeout=LINE_TIMEOUT_S) == -signal.SIGKILL
    killed_at = time.monotonic()

    async with Gateway(redis_url, pg_url, namespace=namespace, wait_timeout_s=60.0) as gw:
        results = await gw.save_many(items)
        stats = gw.stats()
    waited = time.monotonic() - killed_at

    rows = await _table(pg_url)
    print(
        f"\ntaken over {waited:.2f} s after the kill (lease {lease_ms} ms): "
        f"busy={stats.busy} write={stats.write} lost_leases={stats.lost_leases} rows={len(rows)}"
    )
    assert [(r.created, r.source) for r in results] == [(True, "write")] * len(items)
    assert sorted(rows) == sorted(items)
    # The first claims found the dead writer's leases and waited for them to expire.
    assert stats.busy > 0
    assert stats.wait_timeouts == 0 and stats.lost_leases == 0
    assert await markers(redis_url, items, namespace) == "S" * len(items)
    assert await _marker_fields(redis_url, namespace) == len(items)
    assert await _value_keys(redis_url, namespace) == {}
