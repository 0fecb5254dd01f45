"""The load tests of loadtest/: each locustfile runs headless for a few seconds, as a
subprocess (locust monkey-patches whoever imports it), against a real service on real
Redis and PostgreSQL; then ``make load``'s script on a very short run.

What is checked is behaviour, never speed: locust reported requests of every kind and no
failure (from its CSV, and its exit status, which covers the whole run), and the table
holds exactly the distinct values the users got answered, with one ``created`` each.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import PostgresCluster
from tests.test_service import (
    ROOT,
    ServiceProcess,
    rows_for,
    service_on_own_servers,
)

LOADTEST = ROOT / "loadtest"
TOKEN = "load-" + secrets.token_hex(12)
RUN_S = 4  # locust's --run-time in each test
USERS = 8
LOCUST_TIMEOUT_S = RUN_S + 90.0  # start, --stop-timeout 10, reports; generous

pytestmark = pytest.mark.slow


@dataclass
class Target:
    svc: ServiceProcess
    redis_url: str
    database_url: str


@pytest.fixture(scope="module")
def target(
    pg_cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    """One service for the module, with a token, on its own redis-server and database."""
    name = f"load_{os.getpid()}_{secrets.token_hex(4)}"
    url = pg_cluster.create_database(name)
    with service_on_own_servers(
        pg_cluster, tmp_path_factory.mktemp("load"), name, url, DEDUP_AUTH_TOKEN=TOKEN
    ) as (svc, redis_server):
        yield Target(svc, redis_server.url, url)


@dataclass
class LocustRun:
    code: int
    output: str
    stats: dict[tuple[str, str], dict[str, str]]  # (Type, Name) -> the CSV row
    answered: set[str]
    created: int

    def count(self, type_: str, name: str) -> int:
        return int(self.stats[(type_, name)]["Request Count"])

    @property
    def failures(self) -> int:
        return int(self.stats[("", "Aggregated")]["Failure Count"])


def run_locust(
    tmp_path: Path, locustfile: str, env: Mapping[str, str], args: Sequence[str] = ()
) -> LocustRun:
    """locust headless for RUN_S seconds; its CSV stats and the users' record of answers."""
    prefix = tmp_path / "run"
    record = tmp_path / "record.jsonl"
    argv = [
        sys.executable, "-m", "locust", "-f", str(LOADTEST / locustfile), "--headless",
        "--only-summary", "-u", str(USERS), "-r", str(USERS), "-t", f"{RUN_S}s",
        "--stop-timeout", "10", "--csv", str(prefix), "--html", str(tmp_path / "run.html"),
        *args,
    ]  # fmt: skip
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
    child_env.update(env, DEDUP_LOAD_RECORD=str(record))
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env=child_env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=LOCUST_TIMEOUT_S,
        check=False,
    )
    output = done.stdout + done.stderr
    with open(f"{prefix}_stats.csv", newline="") as f:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    answered: set[str] = set()
    created = 0
    if record.exists():
        for line in record.read_text().splitlines():
            entry = json.loads(line)
            answered.update(entry["answered"])
            created += entry["created"]
    assert (tmp_path / "run.html").stat().st_size > 0, output
    return LocustRun(done.returncode, output, stats, answered, created)


def assert_table_matches(run: LocustRun, database_url: str, kind: str) -> None:
    """One row per distinct answered value, no other row, and one ``created`` per row."""
    rows = asyncio.run(rows_for(database_url, kind))
    assert run.answered, run.output
    assert set(rows) == run.answered, run.output[-3000:]
    assert run.created == len(rows)


def load_env(kind: str, **extra: str) -> dict[str, str]:
    # Few values, so that the stream repeats and every tier answers.
    return {
        "DEDUP_LOAD_KIND": kind,
        "DEDUP_LOAD_VALUES": "3000",
        "DEDUP_LOAD_BATCH": "20",
        **extra,
    }


def test_http_locustfile_single_and_batch_users(target: Target, tmp_path: Path) -> None:
    kind = "load-http"
    env = load_env(kind, DEDUP_AUTH_TOKEN=TOKEN)
    run = run_locust(tmp_path, "locustfile.py", env, ["--host", target.svc.url])
    assert run.code == 0, run.output[-3000:]  # locust exits 1 on any failure of the run
    assert run.count("POST", "/v1/save") > 0
    assert run.count("POST", "/v1/save/batch") > 0
    assert run.failures == 0
    assert_table_matches(run, target.database_url, kind)


def test_http_locustfile_counts_refused_requests_as_failures(
    target: Target, tmp_path: Path
) -> None:
    # A wrong token: every request gets 401, which must show as failures, not successes.
    env = load_env("load-refused", DEDUP_AUTH_TOKEN="not-" + TOKEN)
    run = run_locust(tmp_path, "locustfile.py", env, ["--host", target.svc.url])
    assert run.code == 1, run.output[-3000:]
    total = run.stats[("", "Aggregated")]
    assert int(total["Request Count"]) > 0
    assert run.failures == int(total["Request Count"])
    assert "unauthorized" in (tmp_path / "run_failures.csv").read_text()
    assert run.answered == set()


def test_library_locustfile_drives_one_gateway(target: Target, tmp_path: Path) -> None:
    kind = "load-lib"
    env = load_env(kind, DEDUP_REDIS_URL=target.redis_url, DEDUP_DATABASE_URL=target.database_url)
    run = run_locust(tmp_path, "locustfile_lib.py", env)
    assert run.code == 0, run.output[-3000:]
    assert run.count("save", kind) > 0
    assert run.count("save_many", kind) > 0
    assert run.failures == 0
    assert_table_matches(run, target.database_url, kind)


def test_make_load_script_on_a_short_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        sys.executable, str(LOADTEST / "run.py"), "--seconds", "2", "--users", "4",
        "--phases", "single,batch,lib", "--values", "2000", "--batch", "20", "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    lines = done.stdout.splitlines()
    for phase in ("single", "batch", "lib"):
        row = next(line for line in lines if line.startswith(phase + " "))
        assert row.rstrip().endswith("PASS"), output
        requests = int(row.split()[1].replace(",", ""))
        assert requests > 0
        assert (out / f"{phase}_stats.csv").is_file() and (out / f"{phase}.html").is_file()
    assert "failures: 0" in lines
