"""The lock benchmarks run end to end and print the columns their docs describe (on tiny
settings: this checks the scripts, never their figures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_lock_bench_reports_every_variant_and_round() -> None:
    out = _run(
        "lock_bench.py",
        *("--processes", "1", "--tasks", "2", "--seconds", "0.3", "--names", "1,5"),
        *("--redlock-nodes", "2", "--rounds", "2", "--streaks", "1,64"),
    )
    columns = ("acquire+release/s", "requests/acq", "server cmds/acq", "wait p99", "wait max")
    for column in (*columns, "least served"):
        assert column in out
    assert "every round" in out
    for label in (
        "redis-py Lock, sleep=0.1",
        "dedup Lock, sleep=0.1",
        "dedup Redlock",
        "2 x dedup Lock",
        "dedup Lock, handover streak 1",
        "dedup Lock, handover streak 64",
    ):
        assert label in out
    rows = [line for line in out.splitlines() if "ms  " in line]
    assert len(rows) == 2 * 6 + 2  # two shapes of six variants, then the Redlock pair
    # Two rounds: every row lists two rates, and none is zero (every variant acquired);
    # the least-served task's share comes before them.
    for row in rows:
        share, every = row.split("ms ")[-1].split("%  ")
        assert 0 <= int(share) <= 100, row
        rates = every.split(" / ")
        assert len(rates) == 2, row
        assert all(float(rate.replace(",", "")) > 0 for rate in rates), row


def test_lock_cost_prints_cpu_per_acquisition() -> None:
    out = _run("lock_cost.py", "--acquisitions", "200", "--rounds", "1", "--names", "10")
    lines = out.splitlines()
    assert "client CPU us/acq" in lines[0]
    figures = {
        line.split()[0]: [float(x.replace(",", "")) for x in line.split()[1:]] for line in lines[1:]
    }
    assert set(figures) == {"redis-py", "dedup"}
    assert all(value > 0 for row in figures.values() for value in row)
