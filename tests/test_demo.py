"""``dedup demo`` and ``dedup migrate`` as a user runs them, and the settings they read."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dedup import ConfigError
from dedup.cli.demo import make_stream
from dedup.service.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent


def _dedup(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dedup", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        check=False,
    )


SMALL = ["--events", "20000", "--values", "4000", "--concurrency", "64"]


def test_demo_on_the_embedded_default_passes_twice(tmp_path: Path) -> None:
    for _ in range(2):  # each run starts from an empty table and namespace
        run = _dedup("demo", *SMALL, "--data-dir", str(tmp_path))
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert lines[-1] == "rows in table == unique values: PASS"
        unique = len(set(make_stream(20000, 4000, 1.1, 1)))
        table = {m[1]: m[2] for line in lines[:-1] if (m := re.match(r"^(.+?)\s{2,}(\S.*)$", line))}
        assert table["unique values"].strip().replace(",", "") == str(unique)
        assert table["rows in table"].strip().replace(",", "") == str(unique)
        assert table["answers: write (created)"].strip().replace(",", "") == str(unique)
        for name in ("events/s", "p50 latency", "p99 latency", "answers: local",
                     "Redis round trips / event", "DB statements / event"):  # fmt: skip
            assert name in table
        assert "\r" not in run.stdout  # no progress bar when stdout is not a terminal


def test_demo_against_real_servers(redis_url: str, pg_empty_url: str) -> None:
    run = _dedup(
        "demo", *SMALL, "--zipf", "0.8", "--redis-url", redis_url, "--database-url", pg_empty_url
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "rows in table == unique values: PASS"


def test_demo_reads_urls_from_the_environment(redis_url: str, pg_url: str) -> None:
    env = {"DEDUP_REDIS_URL": redis_url, "DEDUP_DATABASE_URL": pg_url}
    run = _dedup("demo", "--events", "3000", "--values", "500", env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1].endswith("PASS")


def test_demo_refuses_bad_flags_without_traceback(tmp_path: Path) -> None:
    for args in (["--events", "0"], ["--zipf", "-1"], ["--concurrency", "0"]):
        run = _dedup("demo", *args, "--data-dir", str(tmp_path))
        assert run.returncode != 0
        assert "error" in run.stderr and "Traceback" not in run.stderr
    run = _dedup("demo", "--events", "ten")
    assert run.returncode == 2 and "invalid int value" in run.stderr


def test_demo_on_a_busy_data_dir_says_so(tmp_path: Path) -> None:
    from dedup._redis.embedded import DataDirLock

    lock = DataDirLock(tmp_path)
    lock.acquire()
    try:
        run = _dedup("demo", *SMALL, "--data-dir", str(tmp_path))
    finally:
        lock.release()
    assert run.returncode != 0
    assert f"data_dir {tmp_path} is in use" in run.stderr
    assert "Traceback" not in run.stderr


def test_migrate_postgres_and_sqlite(pg_empty_url: str, tmp_path: Path) -> None:
    run = _dedup("migrate", "--database-url", pg_empty_url)
    assert run.returncode == 0, run.stderr
    assert "is at revision 0002" in run.stdout
    run = _dedup("migrate", "--data-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr
    with sqlite3.connect(tmp_path / "dedup.sqlite3") as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    conn.close()
    assert "dedup_items" in tables


def test_settings_precedence(tmp_path: Path) -> None:
    config = tmp_path / "dedup.toml"
    config.write_text('[gateway]\nlease_ms = 7000\nnamespace = "from-file"\nmax_batch = 64\n')
    env = {"DEDUP_LEASE_MS": "8000", "DEDUP_NAMESPACE": "from-env"}
    s = load_settings(config_path=config, environ=env, flags={"lease_ms": 9000, "namespace": None})
    assert (s.lease_ms, s.namespace, s.max_batch) == (9000, "from-env", 64)
    assert s.wait_timeout_s == Settings().wait_timeout_s  # default where nobody said
    kwargs = s.gateway_kwargs()
    assert kwargs["redis_url"] is None and kwargs["retention_s"] is None


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("[gateway]\nleese_ms = 1\n", {}, "unknown setting 'leese_ms'"),
        ("[gateway]\nlease_ms = 'soon'\n", {}, "must be int"),
        ("", {"DEDUP_LEASE_MS": "1.5"}, "DEDUP_LEASE_MS must be int"),
        ("", {"DEDUP_ALLOW_EVICTION": "maybe"}, "must be bool"),
        ("[gateway\n", {}, "cannot read config file"),
    ],
)
def test_settings_errors_are_clear(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    config = tmp_path / "dedup.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(config_path=config, environ=env, flags={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(config_path=tmp_path / "missing.toml", environ={}, flags={})


def test_shipped_config_lists_every_setting_with_its_default() -> None:
    import tomllib
    from dataclasses import fields

    document = tomllib.loads((ROOT / "config" / "dedup.toml").read_text())
    assert set(document["gateway"]) == {f.name for f in fields(Settings)}
    shipped = load_settings(config_path=ROOT / "config" / "dedup.toml", environ={}, flags={})
    assert shipped == Settings()


def test_demo_draws_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dedup", "demo", *SMALL, "--data-dir", str(tmp_path)],
            cwd=ROOT,
            stdout=follower,
            stderr=subprocess.DEVNULL,
        )
        os.close(follower)
        chunks: list[bytes] = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closes when the demo exits
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=300) == 0
    finally:
        os.close(leader)
    screen = b"".join(chunks).decode()
    assert "\r[" in screen and "ev/s" in screen
    assert screen.rstrip().endswith("rows in table == unique values: PASS")
