"""``dedup bench --quick`` on tiny sizes: its table and JSON (behaviour, never timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import asyncpg
import redis

ROOT = Path(__file__).resolve().parent.parent


async def test_bench_quick_runs_every_strategy(redis_url: str, pg_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.set("someone-elses-key", "stays")
    finally:
        client.close()
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            "INSERT INTO dedup_items (kind, digest, value) VALUES ('other', '\\x00', 'stays')"
        )
    finally:
        await conn.close()

    run = subprocess.run(
        [sys.executable, "-m", "dedup", "bench", "--quick", "--requests", "3000",
         "--redis-url", redis_url, "--database-url", pg_url, "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == "rows == unique values for every run: PASS"
    report = json.loads((tmp_path / "bench.json").read_text())
    runs = report["runs"]
    singles = {(r["workload"], r["strategy"]) for r in runs if r["processes"] == 1}
    assert singles == {
        (w, s) for w in ("zipf", "uniform") for s in ("textbook", "redis-lock", "db-only", "dedup")
    }
    assert {(r["strategy"], r["processes"]) for r in runs if r["processes"] > 1} == {
        ("db-only", 2),
        ("dedup", 2),
    }
    for r in runs:
        assert r["passed"] and r["rows"] == r["unique"] == r["created"], r
        if r["strategy"] == "dedup":
            assert r["rows_sent"] == r["unique"]  # no duplicate ever reached the database
            if r["processes"] == 1:  # the client's count is what the server saw
                assert r["redis_round_trips"] == r["redis_server_calls"], r
        if r["strategy"] == "textbook" and r["processes"] == 1:
            assert r["redis_round_trips"] >= r["requests"]  # at least one per request
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert report["memory"]["redis_bytes_per_saved_value"] > 0
    assert report["ceilings"]["bulk_copy_rows_per_s"] > 0
    # It removed its own keys and rows only.
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.get("someone-elses-key") == b"stays"
    finally:
        client.close()
    conn = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM dedup_items WHERE kind = 'other'") == 1
        assert await conn.fetchval("SELECT count(*) FROM dedup_items WHERE kind = 'bench'") == 0
    finally:
        await conn.close()
