"""The ``dedup`` command as a user runs it (``python -m dedup ...`` in a subprocess),
and the settings it reads (flag > ``DEDUP_*`` > config file > default)."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

import asyncpg
import pytest
import redis
from redis.asyncio import Redis

from dedup import ConfigError, Gateway
from dedup._claims.keys import KeySpace
from dedup._claims.protocol import Claims
from dedup._redis.script import REDIS_7
from dedup._redis.server import script_variant
from dedup._values import digest
from dedup.cli.demo import DEMO_KINDS, make_stream, value_of
from dedup.metrics import Stats
from dedup.service.settings import ServiceSettings, Settings, load_service_settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_CONFIG = ROOT / "config" / "dedup.toml"
RUN_TIMEOUT_S = 120.0
EVENTS, VALUES, CONCURRENCY = 20_000, 4_000, 64
SMALL = ["--events", str(EVENTS), "--values", str(VALUES), "--concurrency", str(CONCURRENCY)]
VERDICT_PASS = "rows in table == unique values: PASS"
TABLE_NAMES = (
    "events",
    "unique values",
    "events/s",
    "p50 latency",
    "p99 latency",
    "answers: local",
    "answers: inflight",
    "answers: redis",
    "answers: db",
    "answers: write (created)",
    "failed saves",
    "Redis round trips / event",
    "DB statements / event",
    "rows in table",
)


def _dedup(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dedup ARGS`` from the repository root, with no inherited DEDUP_*."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
    return subprocess.run(
        [sys.executable, "-m", "dedup", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={**clean, **(env or {})},
        check=False,
    )


async def _dedup_async(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(_dedup, *args, env=env)


def _table(stdout: str) -> dict[str, str]:
    """The demo's summary table, ``name -> value``; checks the verdict is the last line."""
    lines = stdout.splitlines()
    assert lines, "the demo printed nothing"
    assert lines[-1] == VERDICT_PASS, stdout[-2000:]
    table: dict[str, str] = {}
    for line in lines[:-1]:
        match = re.fullmatch(r"(\S.*?)\s{2,}(\S.*)", line)
        if match:
            table[match[1]] = match[2].strip()
    for name in TABLE_NAMES:
        assert name in table, f"{name!r} missing from the table:\n{stdout}"
    return table


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _ok(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr}"
    assert "Traceback" not in run.stderr


def _refused(run: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit non-zero with a one-line message on stderr that names every needle; no traceback."""
    assert run.returncode != 0, run.stdout
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip(), "no message on stderr"
    for needle in needles:
        assert needle in run.stderr, run.stderr


# ---------------------------------------------------------------------------------- demo


def test_version_prints_the_installed_version_and_exits_0() -> None:
    from importlib.metadata import version

    run = _dedup("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"dedup {version('dedup')}\n"


def test_demo_embedded_passes_twice_on_one_data_dir(tmp_path: Path) -> None:
    unique = len(set(make_stream(EVENTS, VALUES, 1.1, 1)))  # the demo's defaults
    for attempt in range(2):  # each run purges its kinds and namespace first
        run = _dedup("demo", *SMALL, "--data-dir", str(tmp_path))
        _ok(run)
        table = _table(run.stdout)
        print(f"\nrun {attempt + 1}: " + ", ".join(f"{k}={table[k]}" for k in TABLE_NAMES[:5]))
        assert _number(table["events"]) == EVENTS
        assert _number(table["unique values"]) == unique
        assert _number(table["rows in table"]) == unique
        assert _number(table["answers: write (created)"]) == unique
        assert _number(table["failed saves"]) == 0
        assert table["p99 latency"].endswith(" ms")
        # Not a terminal: no progress bar, no carriage returns.
        assert "\r" not in run.stdout and "ev/s" not in run.stdout
    with sqlite3.connect(tmp_path / "dedup.sqlite3") as conn:
        rows = conn.execute("SELECT count(*) FROM dedup_items").fetchone()[0]
    conn.close()
    assert rows == unique


async def test_demo_against_real_servers(redis_url: str, pg_url: str) -> None:
    seed, zipf = 7, 0.9
    unique = len(set(make_stream(EVENTS, VALUES, zipf, seed)))
    # Someone else's row, and a stale row of the demo's own kinds (purged first).
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.executemany(
            "INSERT INTO dedup_items (kind, digest, value) VALUES ($1, $2, $3)",
            [("keep", digest("mine"), "mine"), (DEMO_KINDS[0], digest("stale"), "stale")],
        )
    finally:
        await conn.close()

    run = await _dedup_async(
        "demo", *SMALL, "--seed", str(seed), "--zipf", str(zipf),
        "--redis-url", redis_url, "--database-url", pg_url,
    )  # fmt: skip
    _ok(run)
    table = _table(run.stdout)
    assert _number(table["unique values"]) == unique
    assert _number(table["rows in table"]) == unique
    assert _number(table["answers: write (created)"]) == unique
    assert "\r" not in run.stdout

    conn = await asyncpg.connect(pg_url)
    try:
        demo_rows = await conn.fetchval(
            "SELECT count(*) FROM dedup_items WHERE kind = ANY($1::text[])", list(DEMO_KINDS)
        )
        kept = await conn.fetchval("SELECT count(*) FROM dedup_items WHERE kind = 'keep'")
    finally:
        await conn.close()
    assert demo_rows == unique  # the stale row was purged, the stream's rows are there
    assert kept == 1  # other kinds' rows are never touched


async def test_demo_keeps_to_its_own_redis_namespace(redis_url: str, pg_url: str) -> None:
    """docs/getting-started.md: the demo purges only its own namespace ``dedup-demo``, so it may run
    against a shared Redis without touching the markers of the Gateway's default
    namespace ``dedup`` (or of anything else)."""
    async with Gateway(redis_url, pg_url) as gw:  # the default namespace, "dedup"
        assert (await gw.save("email", "prod@example.com")).created
    client = Redis.from_url(redis_url)
    try:
        await client.set("other-app:key", "1")
        before = {k async for k in client.scan_iter(match="dedup:*")}
        assert len(before) == 1

        run = await _dedup_async(
            "demo", "--events", "2000", "--values", "500",
            "--redis-url", redis_url, "--database-url", pg_url,
        )  # fmt: skip
        _ok(run)
        demo_keys = [k async for k in client.scan_iter(match="dedup-demo:*", count=1000)]
        buckets = [k for k in demo_keys if await client.type(k) == b"hash"]
        demo_markers = sum([await client.hlen(k) for k in buckets])
        after = {k async for k in client.scan_iter(match="dedup:*")}
        other = await client.get("other-app:key")
        # What dedup-demo: holds for each of the demo's values (any marker layout).
        ranks = range(500)
        space = KeySpace("dedup-demo")
        claims = Claims(client, lease_ms=1, retention_ms=0, stats=Stats())
        states = await claims.states([space.key(k, digest(v)) for k, v in map(value_of, ranks)])
    finally:
        await client.aclose()
    unique = _number(_table(run.stdout)["unique values"])
    streamed = set(make_stream(2000, 500, 1.1, 1))  # the demo's default zipf and seed
    assert other == b"1"
    # One saved marker per unique value, all under dedup-demo:, and only the values
    # of the stream saved there.
    assert unique == len(streamed)
    assert states.count("S") == unique, "the demo's markers are not under dedup-demo:"
    assert {r for r in ranks if states[r] == "S"} == streamed
    assert demo_markers == unique, "the demo's markers are not under dedup-demo:"
    assert after == before, "the demo purged (or wrote to) the default namespace dedup:"


async def test_demo_on_a_data_dir_held_by_another_gateway(tmp_path: Path) -> None:
    data_dir = tmp_path / "held"
    async with Gateway(data_dir=data_dir) as gw:
        assert (await gw.save("email", "a@example.com")).created
        run = await _dedup_async("demo", *SMALL, "--data-dir", str(data_dir))
    _refused(run, str(data_dir), "in use", str(os.getpid()))
    assert VERDICT_PASS not in run.stdout
    # Released with the Gateway: the same folder works now.
    run = await _dedup_async(
        "demo", "--events", "2000", "--values", "500", "--data-dir", str(data_dir)
    )
    _ok(run)
    assert run.stdout.splitlines()[-1] == VERDICT_PASS


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["--events", "0"], {}, ["--events must be at least 1"]),
        (["--values", "0"], {}, ["--values must be at least 1"]),
        (["--concurrency", "0"], {}, ["--concurrency must be at least 1"]),
        (["--zipf", "-1"], {}, ["--zipf"]),
        (["--events", "ten"], {}, ["invalid int value"]),
        ([], {"DEDUP_LEASE_MS": "soon"}, ["DEDUP_LEASE_MS", "int"]),
        ([], {"DEDUP_LEASE_MS": "50"}, ["lease_ms must be at least 100"]),
        (["--redis-url", "http://x"], {}, ["redis_url must start with"]),
        (["--config", "/nonexistent/dedup.toml"], {}, ["/nonexistent/dedup.toml", "not exist"]),
    ],
)
def test_demo_refuses_bad_input_without_traceback(
    tmp_path: Path, args: list[str], env: dict[str, str], needles: list[str]
) -> None:
    # SMALL first: a flag given again later wins in argparse.
    run = _dedup("demo", *SMALL, "--data-dir", str(tmp_path / "d"), *args, env=env)
    _refused(run, *needles)
    assert run.stdout == ""


def test_cli_without_a_command_is_refused() -> None:
    _refused(_dedup(), "usage: dedup")
    _refused(_dedup("nonsense"), "invalid choice")


# ------------------------------------------------------------------------------- migrate


async def test_migrate_postgres(pg_empty_url: str) -> None:
    run = await _dedup_async("migrate", "--database-url", pg_empty_url)
    _ok(run)
    assert re.search(r"is at revision 0002\b", run.stdout), run.stdout
    conn = await asyncpg.connect(pg_empty_url)
    try:
        table = await conn.fetchval("SELECT to_regclass('public.dedup_items')::text")
        revision = await conn.fetchval("SELECT version_num FROM alembic_version")
    finally:
        await conn.close()
    assert table == "dedup_items"
    assert revision == "0002"
    # Again: nothing to do, same answer.
    run = await _dedup_async("migrate", "--database-url", pg_empty_url)
    _ok(run)
    assert "is at revision 0002" in run.stdout


def test_migrate_embedded_sqlite(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    run = _dedup("migrate", "--data-dir", str(data_dir))
    _ok(run)
    assert "is at revision 0002" in run.stdout
    assert _tables(data_dir / "dedup.sqlite3") >= {"dedup_items", "alembic_version"}


def _tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    conn.close()
    return names


def test_migrate_follows_flag_env_file_precedence(tmp_path: Path) -> None:
    """The same setting from every source: the strongest source picks the database."""

    def url(name: str) -> str:
        return f"sqlite:///{tmp_path / name / 'dedup.sqlite3'}"

    config = tmp_path / "dedup.toml"
    config.write_text(
        f'[gateway]\ndatabase_url = "{url("file")}"\ndata_dir = "{tmp_path / "file-dir"}"\n'
    )
    env = {"DEDUP_DATABASE_URL": url("env")}
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    default_dir = str(tmp_path / "default")
    cases = [
        (["--config", str(config), "migrate", "--database-url", url("flag")], env, "flag"),
        (["--config", str(config), "migrate"], env, "env"),
        (["migrate", "--config", str(config)], {}, "file"),  # --config after the command too
        (["--config", str(empty), "migrate", "--data-dir", default_dir], {}, "default"),
    ]
    made: list[str] = []
    for args, environ, expected in cases:
        run = _dedup(*args, env=environ)
        _ok(run)
        assert f"/{expected}/dedup.sqlite3 is at revision 0002" in run.stdout, run.stdout
        made.append(expected)
        found = {p.parent.name for p in tmp_path.glob("*/dedup.sqlite3")}
        assert found == set(made), (expected, found)  # nothing else was created


@pytest.mark.parametrize(
    ("url", "needles"),
    [
        ("postgresql://postgres:s3cret@127.0.0.1:1/nothing", ["127.0.0.1:1"]),  # refused
        ("http://example.invalid/db", ["http"]),  # not a database URL
    ],
)
def test_migrate_refuses_a_bad_or_unreachable_database_without_traceback(
    url: str, needles: list[str]
) -> None:
    run = _dedup("migrate", "--database-url", url)
    _refused(run, "dedup: error:", *needles)
    assert "s3cret" not in run.stderr  # the password is never printed


def test_migrate_with_a_missing_config_file_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    _refused(_dedup("--config", str(missing), "migrate"), str(missing), "does not exist")
    _refused(_dedup("migrate", "--config", str(missing)), str(missing), "does not exist")


def test_migrate_with_a_bad_config_file_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "dedup.toml"
    config.write_text("[gateway]\nleese_ms = 1\n")
    _refused(_dedup("--config", str(config), "migrate"), "leese_ms", str(config))


# ------------------------------------------------------------------------------ settings


def test_settings_precedence_flag_env_file_default(tmp_path: Path) -> None:
    config = tmp_path / "dedup.toml"
    config.write_text(
        "[gateway]\n"
        "lease_ms = 7000\n"  # also in env and flags: the flag wins
        "wait_timeout_s = 3.5\n"  # also in env: env wins
        'namespace = "from-file"\n'  # only here (flag None means "not given")
        "allow_eviction = true\n"
    )
    environ = {
        "DEDUP_LEASE_MS": "8000",
        "DEDUP_WAIT_TIMEOUT_S": "4.5",
        "DEDUP_MAX_BATCH": "64",  # only here
        "DEDUP_UNRELATED": "x",  # not a setting: ignored
        "LEASE_MS": "1",  # no prefix: ignored
    }
    flags = {"lease_ms": 9000, "namespace": None, "redis_url": "redis://flag:6379/0"}
    s = load_settings(config_path=config, environ=environ, flags=flags)
    assert s.lease_ms == 9000
    assert s.wait_timeout_s == 4.5
    assert s.max_batch == 64
    assert s.namespace == "from-file"
    assert s.allow_eviction is True
    assert s.redis_url == "redis://flag:6379/0"
    default = Settings()
    assert s.max_pending == default.max_pending  # nobody said: the default
    assert s.data_dir == default.data_dir
    # Without the flag, env wins; without env, the file; without the file, the default.
    assert load_settings(config_path=config, environ=environ, flags={}).lease_ms == 8000
    assert load_settings(config_path=config, environ={}, flags={}).lease_ms == 7000
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert load_settings(config_path=empty, environ={}, flags={}) == default
    kwargs = s.gateway_kwargs()
    assert kwargs["database_url"] is None and kwargs["retention_s"] is None
    assert kwargs["redis_url"] == "redis://flag:6379/0"


@pytest.mark.parametrize(
    ("text", "env", "pattern"),
    [
        ("[gateway]\nleese_ms = 1\n", {}, r"toml: unknown setting 'leese_ms' in \[gateway\]"),
        ("[gatewy]\nlease_ms = 1\n", {}, r"unknown table \[gatewy\]"),
        ("[gateway]\nlease_ms = 'soon'\n", {}, r"setting lease_ms from .*dedup\.toml must be int"),
        ("[gateway]\nlease_ms = 1.5\n", {}, r"lease_ms .* must be int, got 1\.5"),
        ("[gateway]\nredis_url = 6379\n", {}, r"redis_url .* must be str"),
        ("", {"DEDUP_LEASE_MS": "soon"}, r"setting lease_ms from DEDUP_LEASE_MS must be int"),
        ("", {"DEDUP_WAIT_TIMEOUT_S": "ten"}, r"DEDUP_WAIT_TIMEOUT_S must be float"),
        ("", {"DEDUP_ALLOW_EVICTION": "maybe"}, r"DEDUP_ALLOW_EVICTION must be bool"),
        ("[gateway\n", {}, r"cannot read config file"),
    ],
)
def test_settings_errors_name_the_setting_and_its_source(
    tmp_path: Path, text: str, env: dict[str, str], pattern: str
) -> None:
    config = tmp_path / "dedup.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=pattern):
        load_settings(config_path=config, environ=env, flags={})


def test_settings_from_a_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*missing\.toml does not exist"):
        load_settings(config_path=tmp_path / "missing.toml", environ={}, flags={})


def test_settings_without_a_file_are_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no config/dedup.toml here: the default file is optional
    assert load_settings(config_path=None, environ={}, flags={}) == Settings()


def test_shipped_config_lists_every_setting_with_its_true_default() -> None:
    document = tomllib.loads(SHIPPED_CONFIG.read_text())
    assert set(document) == {"gateway", "service"}
    for table, cls in (("gateway", Settings), ("service", ServiceSettings)):
        declared = {f.name: f for f in fields(cls)}
        assert set(document[table]) == set(declared), table
        default = cls()
        for name, raw in document[table].items():
            expected = getattr(default, name)
            # Same value and same TOML type (10.0, not 10, for a float setting).
            assert (type(raw), raw) == (type(expected), expected), (table, name)
    assert load_settings(config_path=SHIPPED_CONFIG, environ={}, flags={}) == Settings()
    assert load_service_settings(config_path=SHIPPED_CONFIG, environ={}, flags={}) == (
        ServiceSettings()
    )


@pytest.mark.redis6
def test_check_names_the_redis_version_and_the_scripts(redis_url: str, tmp_path: Path) -> None:
    """`dedup check` says which Redis it found and which script variant a Gateway would
    choose; for the embedded default, the binary it would start and its version."""
    client = redis.Redis.from_url(redis_url)
    try:
        info = client.info("server")
    finally:
        client.close()
    version = str(info["redis_version"])
    variant = script_variant({"redis_version": version})
    # Valkey reports a Redis-compatible redis_version and its own valkey_version.
    found = f"Redis {version}"
    if "valkey_version" in info:
        found = f"Valkey {info['valkey_version']} ({found})"
    sqlite = f"sqlite:///{tmp_path / 'x.sqlite3'}"
    run = _dedup("check", "--redis-url", redis_url, "--database-url", sqlite)
    assert f"OK   redis    {redis_url}: reachable, {found}\n" in run.stdout, run.stdout
    assert f"OK   redis    scripts: {variant.name} (Redis {variant.since[0]}." in run.stdout
    assert ("Redis 7.0+ would save a command per new value" in run.stdout) == (
        variant is not REDIS_7
    )
    # The embedded default: the redis-server on PATH (the one the fixtures started).
    run = _dedup("check", "--data-dir", str(tmp_path / "data"))
    assert run.returncode == 0, run.stdout + run.stderr
    binary = found.split(" (")[0]  # the binary's own name and version
    assert f"({binary}), started on a unix socket" in run.stdout, run.stdout
    assert f"OK   redis    scripts: {variant.name} " in run.stdout


@pytest.mark.parametrize(
    ("version", "refused"),
    [("5.0.14", True), ("6.0.16", False), ("6.2.14", False), ("7.0.15", False)],
)
def test_setup_refuses_only_a_redis_older_than_6(
    tmp_path: Path, version: str, refused: bool
) -> None:
    # A stand-in redis-server first on PATH: only its --version answer matters here.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "redis-server").write_text(f"#!/bin/sh\necho 'Redis server v={version} sha=0'\n")
    (fake / "redis-server").chmod(0o755)
    setup = Path(__file__).parent.parent / "scripts" / "setup.sh"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(setup), "--tests"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if refused:
        assert done.returncode == 1
        assert f"redis-server {version} is older than 6.0" in done.stderr
        assert "first on PATH" in done.stderr
        return
    # Past the check; the rest of the set-up is already done here.
    assert done.returncode == 0, done.stderr
    assert "older than" not in done.stderr
    assert ("uses its Redis 6 scripts" in done.stderr) == version.startswith("6.")
