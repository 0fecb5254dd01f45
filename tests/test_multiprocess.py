"""Several OS processes on one Redis and one PostgreSQL: exactly one created=True per value."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

from dedup import Gateway

ROOT = Path(__file__).resolve().parent.parent


def _spawn(job: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.gw_child", json.dumps(job)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def read_line(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    """One whole line of the child's stdout, bounded in time.

    The pipe is read without blocking, and a text readline on a non-blocking
    pipe may return part of a line when the rest has not arrived yet: the
    parts are joined until the newline comes."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    parts: list[str] = []
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        while time.monotonic() < deadline:
            part = proc.stdout.readline()
            if part:
                parts.append(part)
                if part.endswith("\n"):
                    return "".join(parts).strip()
                continue
            if proc.poll() is not None:
                raise AssertionError(f"child exited with {proc.returncode}: {''.join(parts)!r}")
            time.sleep(0.02)
    finally:
        os.set_blocking(proc.stdout.fileno(), True)
    raise AssertionError(f"child did not answer in time: {''.join(parts)!r}")


async def _rows(pg_url: str) -> int:
    conn = await asyncpg.connect(pg_url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM dedup_items"))
    finally:
        await conn.close()


async def test_processes_save_overlapping_values_exactly_once(
    redis_url: str, pg_url: str, children: list[subprocess.Popen[str]]
) -> None:
    values = [f"p{i}" for i in range(2000)]
    for n in range(4):
        stream = values * 2
        random.Random(n).shuffle(stream)
        children.append(
            _spawn(
                {
                    "mode": "save",
                    "redis_url": redis_url,
                    "database_url": pg_url,
                    "values": stream,
                    "concurrency": 64,
                    "options": {"max_batch": 128},
                }
            )
        )
    for p in children:
        assert read_line(p) == "READY"
    for p in children:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    answers: list[dict[str, Any]] = []
    for p in children:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        answers += [json.loads(line) for line in out.splitlines() if line]
    errors = [a for a in answers if "error" in a]
    created: dict[str, int] = dict.fromkeys(values, 0)
    for a in answers:
        if a.get("created"):
            created[a["value"]] += 1
        if "created" in a:
            assert a["created"] == (a["source"] == "write")
    rows = await _rows(pg_url)
    print(f"\nacknowledged={len(answers) - len(errors)} errors={len(errors)} rows={rows}")
    assert errors == []
    assert len(answers) == 4 * len(values) * 2
    assert set(created.values()) == {1}  # exactly one created=True per value
    assert rows == len(values)


async def test_killed_lease_holder_is_taken_over(
    redis_url: str, pg_url: str, children: list[subprocess.Popen[str]]
) -> None:
    values = [f"h{i}" for i in range(300)]
    holder = _spawn(
        {"mode": "hold", "redis_url": redis_url, "values": values, "options": {"lease_ms": 1500}}
    )
    children.append(holder)
    assert read_line(holder) == "HOLDING"  # its claim batch won: the leases are held
    holder.kill()  # SIGKILL: no release, no goodbye
    holder.wait(timeout=30)
    async with Gateway(redis_url, pg_url, wait_timeout_s=30) as gw:
        started = time.monotonic()
        results = await gw.save_many([("email", v) for v in values])
        waited = time.monotonic() - started
        stats = gw.stats()
    assert all((r.created, r.source) == (True, "write") for r in results)
    assert await _rows(pg_url) == len(values)
    assert stats.busy > 0  # they found the dead writer's leases and waited them out
    print(f"\ntaken over after {waited:.2f} s; busy answers={stats.busy}")
