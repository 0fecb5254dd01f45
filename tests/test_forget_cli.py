"""``dedup forget`` and ``dedup prune`` as a user runs them (``python -m dedup ...`` in a
subprocess) against real redis-server and PostgreSQL, and their pieces in-process:
``--older-than`` parsing, the file reader and the progress bar.

Rows are checked in the database itself; a forgotten value must save anew
(``created=True``) through a fresh Gateway, which proves its Redis marker is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from dedup import Gateway
from dedup._values import digest
from dedup.cli import build_parser
from dedup.cli.forget import (
    MAX_OLDER_THAN_S,
    ProgressBar,
    older_than_arg,
    parse_duration,
    read_values,
)
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 120.0
DEADLINE_S = 60.0


# ----------------------------------------------------------------------------- helpers


def _env(redis_url: str, database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
    return {**env, "DEDUP_REDIS_URL": redis_url, "DEDUP_DATABASE_URL": database_url, **extra}


def _dedup(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dedup ARGS`` from the repository root, with no inherited DEDUP_*."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}
    return subprocess.run(
        [sys.executable, "-m", "dedup", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        timeout=RUN_TIMEOUT_S,
        env=env,
        check=False,
    )


async def _run(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """:func:`_dedup` in a thread, so that the test's event loop keeps running."""
    return await asyncio.to_thread(_dedup, *args, env=env, stdin=stdin)


def _ok(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr
    return run.stdout


def _refused(run: subprocess.CompletedProcess[str], status: int, *needles: str) -> str:
    """Exit ``status`` with a message on stderr naming every needle; no traceback."""
    assert run.returncode == status, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip(), "no message on stderr"
    for needle in needles:
        assert needle in run.stderr, run.stderr
    return run.stderr


async def _save(redis_url: str, pg_url: str, kind: str, values: Iterable[str]) -> list[bool]:
    """Save ``values`` through a Gateway of its own; ``created`` of each."""
    async with Gateway(redis_url, pg_url) as gw:
        results = await gw.save_many([(kind, v) for v in values])
    return [r.created for r in results]


async def _values(pg_url: str, kind: str) -> set[str]:
    conn = await asyncpg.connect(pg_url, timeout=DEADLINE_S)
    try:
        rows = await conn.fetch("SELECT value FROM dedup_items WHERE kind = $1", kind)
    finally:
        await conn.close()
    return {r["value"] for r in rows}


async def _age(pg_url: str, kind: str, values: Iterable[str], days: int) -> None:
    """Make the rows of ``values`` ``days`` old."""
    conn = await asyncpg.connect(pg_url, timeout=DEADLINE_S)
    try:
        status = await conn.execute(
            "UPDATE dedup_items SET created_at = now() - make_interval(days => $3) "
            "WHERE kind = $1 AND value = ANY($2::text[])",
            kind,
            list(values),
            days,
        )
    finally:
        await conn.close()
    assert status == f"UPDATE {len(list(values))}", status


_FORGOT = re.compile(r"forgot (\d+) of (\d+) values \((\d+) had no row\)")


def _forgot(stdout: str) -> tuple[int, int, int]:
    match = _FORGOT.fullmatch(stdout.strip())
    assert match, stdout
    forgot, total, absent = map(int, match.groups())
    return forgot, total, absent


_PRUNED = re.compile(r"pruned (\d+) rows of kind (\S+) older than (\S+)")


def _pruned(stdout: str, kind: str, older_than_s: float) -> int:
    """The count of ``pruned N rows of kind K older than <ISO>``; checks K and the cutoff."""
    match = _PRUNED.fullmatch(stdout.strip())
    assert match, stdout
    assert match[2] == kind
    cutoff = datetime.fromisoformat(match[3])
    assert cutoff.tzinfo is not None, match[3]
    expected = datetime.now(UTC) - timedelta(seconds=older_than_s)
    assert abs((cutoff - expected).total_seconds()) < DEADLINE_S + RUN_TIMEOUT_S, match[3]
    return int(match[1])


# ------------------------------------------------------------------- --older-than


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30d", 30 * 86400.0),
        ("12h", 12 * 3600.0),
        ("90m", 90 * 60.0),
        ("45s", 45.0),
        ("3600", 3600.0),
        ("1", 1.0),
        ("0.5", 0.5),
        ("1.5h", 5400.0),
        ("7D", 7 * 86400.0),
        (" 30d ", 30 * 86400.0),
        ("36500d", 36500 * 86400.0),
    ],
)
def test_older_than_accepts(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert older_than_arg(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "0",
        "0d",
        "0.0s",
        "-5d",
        "-1",
        "+5d",
        "abc",
        "30x",
        "d",
        "30 d",
        "1d2h",
        "1.5.3",
        ".5h",
        "1e3",
        "inf",
        "nan",
        "30dd",
        "36501d",
        "9" * 400,
    ],
)
def test_older_than_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
    with pytest.raises(argparse.ArgumentTypeError):
        older_than_arg(text)


def test_older_than_limit_is_a_hundred_years() -> None:
    assert parse_duration(f"{MAX_OLDER_THAN_S:.0f}") == MAX_OLDER_THAN_S
    with pytest.raises(ValueError, match="100 years"):
        parse_duration(f"{MAX_OLDER_THAN_S + 1:.0f}")


def test_parser_takes_forget_and_prune() -> None:
    parser = build_parser()
    args = parser.parse_args(["forget", "--kind", "email", "a@x", "b@x", "--", "-c"])
    assert (args.command, args.kind, args.values, args.file) == (
        "forget",
        "email",
        ["a@x", "b@x", "-c"],
        None,
    )
    args = parser.parse_args(["forget", "--kind", "email", "--file", "-"])
    assert (args.values, args.file) == ([], "-")
    args = parser.parse_args(["prune", "--kind", "email", "--older-than", "30d"])
    assert (args.older_than, args.batch_size) == (30 * 86400.0, 1000)
    args = parser.parse_args(
        ["prune", "--kind", "e", "--older-than", "45", "--batch-size", "10", "--config", "x.toml"]
    )
    assert (args.older_than, args.batch_size, args.config) == (45.0, 10, "x.toml")
    for argv in (
        ["prune", "--kind", "e", "--older-than", "0"],
        ["prune", "--kind", "e", "--older-than", "soon"],
        ["prune", "--kind", "e", "--older-than", "30d", "--batch-size", "0"],
        ["prune", "--kind", "e", "--older-than", "30d", "--batch-size", "x"],
        ["prune", "--kind", "e"],
        ["prune", "--older-than", "30d"],
        ["forget", "a@x"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2, argv


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--older-than", "0"], "above zero"),
        (["--older-than=-5d"], "-5d"),
        (["--older-than", "-5d"], "expected one argument"),  # read as an option
        (["--older-than", "30x"], "30x"),
        (["--older-than", "30d", "--batch-size", "0"], "at least 1"),
    ],
)
def test_prune_refuses_a_bad_duration_with_exit_2(argv: list[str], needle: str) -> None:
    # Refused by the parser, before any server is reached (none is configured here).
    run = _dedup("prune", "--kind", "k", *argv)
    _refused(run, 2, needle)
    assert "--older-than" in run.stderr or "--batch-size" in run.stderr
    assert run.stdout == ""


# ------------------------------------------------------------------------ the reader


def test_read_values_strips_only_the_newline() -> None:
    raw = (
        b"plain\n"
        b"\n"  # skipped
        b"  spaced  \n"  # spaces are part of the value
        b"\ttabbed\t\n"
        b"crlf\r\n"  # only the \n goes: the \r stays
        b"\xc3\xa9t\xc3\xa9\n"
        b"\n\n"
        b"last without newline"
    )
    values, lines = read_values(io.BytesIO(raw))
    assert values == ["plain", "  spaced  ", "\ttabbed\t", "crlf\r", "été", "last without newline"]
    assert lines == [1, 3, 4, 5, 6, 9]
    assert read_values(io.BytesIO(b"")) == ([], [])
    assert read_values(io.BytesIO(b"\n\n\n")) == ([], [])


def test_read_values_names_the_line_that_is_not_utf8() -> None:
    with pytest.raises(ValueError, match=r"line 3: not valid UTF-8"):
        read_values(io.BytesIO(b"a\n\n\xff\xfe\nb\n"))


# ---------------------------------------------------------------------- progress bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_bar_on_a_terminal() -> None:
    out, clock = _Terminal(), _Clock()
    bar = ProgressBar(out, interval_s=0.1, clock=clock)
    clock.now += 2.0
    bar(1000, 4000)
    assert out.getvalue() == "\r[#######.......................] 1,000/4,000  25.0%  500 rows/s"
    clock.now += 0.01
    bar(2000, 4000)  # too soon after the last draw: not drawn
    assert out.getvalue().count("\r") == 1
    assert (bar.done, bar.total) == (2000, 4000)
    clock.now += 0.2
    bar(3000, 4000)
    assert out.getvalue().count("\r") == 2
    bar(4000, 4000)  # the end is always drawn
    assert out.getvalue().endswith("4,000/4,000 100.0%  1,810 rows/s")
    bar.finish()
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1
    bar.finish()  # once only
    assert out.getvalue().count("\n") == 1


def test_progress_bar_with_nothing_to_do_and_more_than_counted() -> None:
    out, clock = _Terminal(), _Clock()
    bar = ProgressBar(out, clock=clock)
    bar(0, 0)
    assert "0/0 100.0%" in out.getvalue() and "[" + "#" * 30 + "]" in out.getvalue()
    bar(12, 10)  # rows that turned old meanwhile: never past 100 %
    assert "12/10 100.0%" in out.getvalue()


def test_progress_bar_is_silent_off_a_terminal() -> None:
    out = io.StringIO()
    bar = ProgressBar(out)
    bar(5, 10)
    bar(10, 10)
    bar.finish()
    assert out.getvalue() == ""
    assert (bar.done, bar.total) == (10, 10)


# ---------------------------------------------------------------------------- forget


async def test_forget_values_given_as_arguments(redis_url: str, pg_url: str) -> None:
    await _save(redis_url, pg_url, "email", ["a@x", "b@x", "keep@x", "-dash"])
    await _save(redis_url, pg_url, "phone", ["a@x"])  # same value, other kind
    env = _env(redis_url, pg_url)
    run = await _run("forget", "--kind", "email", "a@x", "nobody@x", "b@x", "--", "-dash", env=env)
    assert _forgot(_ok(run)) == (3, 4, 1)
    assert "a@x" not in run.stdout + run.stderr  # counts only, never the values...
    assert digest("a@x").hex() in run.stderr  # ...and the audit log's digests
    assert await _values(pg_url, "email") == {"keep@x"}
    assert await _values(pg_url, "phone") == {"a@x"}
    # Forgotten everywhere: a fresh Gateway writes them again.
    created = await _save(redis_url, pg_url, "email", ["a@x", "b@x", "-dash", "keep@x"])
    assert created == [True, True, True, False]
    # Again: every value has its row back; forgetting twice answers "no row" the second time.
    run = await _run("forget", "--kind", "email", "a@x", "a@x", env=env)
    assert _forgot(_ok(run)) == (1, 2, 1)


async def test_forget_values_from_a_file_and_stdin(
    redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    values = ["one", "  spaced  ", "été", "tab\there", "x" * 8192]
    await _save(redis_url, pg_url, "f", [*values, "kept"])
    path = tmp_path / "values.txt"
    path.write_bytes(
        b"\n".join(v.encode() for v in values[:2]) + b"\n\n" + values[2].encode() + b"\n"
    )
    env = _env(redis_url, pg_url)
    run = await _run("forget", "--kind", "f", "--file", str(path), env=env)
    assert _forgot(_ok(run)) == (3, 3, 0)
    assert await _values(pg_url, "f") == {"tab\there", "x" * 8192, "kept"}
    # Standard input, the last line without its newline; chunks of 10,000 values at most.
    stdin = "\n".join(values[3:]) + "\n" + "\n".join(f"none-{i}" for i in range(12_000))
    run = await _run("forget", "--kind", "f", "--file", "-", env=env, stdin=stdin)
    assert _forgot(_ok(run)) == (2, 12_002, 12_000)
    assert await _values(pg_url, "f") == {"kept"}
    assert await _save(redis_url, pg_url, "f", values) == [True] * len(values)


async def test_forget_checks_every_value_before_deleting_any(
    redis_url: str, pg_url: str, tmp_path: Path
) -> None:
    await _save(redis_url, pg_url, "bad", ["a", "b"])
    env = _env(redis_url, pg_url)
    too_long = "secret-" + "y" * 8200  # over max_value_bytes (8192)
    path = tmp_path / "bad.txt"
    path.write_text(f"a\n\nb\n{too_long}\n")
    run = await _run("forget", "--kind", "bad", "--file", str(path), env=env)
    stderr = _refused(run, 2, "line 4", "value")
    assert "secret-" not in stderr and run.stdout == ""
    path.write_bytes(b"a\nb\n\xff\n")
    _refused(await _run("forget", "--kind", "bad", "--file", str(path), env=env), 2, "line 3")
    path.write_bytes(b"a\nnul\x00here\n")
    _refused(await _run("forget", "--kind", "bad", "--file", str(path), env=env), 2, "line 2")
    _refused(await _run("forget", "--kind", "bad", "a", too_long, env=env), 2, "value 2")
    _refused(await _run("forget", "--kind", "", "a", env=env), 2, "--kind")
    _refused(await _run("forget", "--kind", "k\n", "a", env=env), 2, "--kind")
    missing = tmp_path / "missing.txt"
    _refused(await _run("forget", "--kind", "bad", "--file", str(missing), env=env), 2, "--file")
    _refused(
        await _run("forget", "--kind", "bad", "a", "--file", str(path), env=env), 2, "not both"
    )
    _refused(await _run("forget", "--kind", "bad", env=env), 2, "no values")
    assert await _values(pg_url, "bad") == {"a", "b"}  # nothing was deleted
    # Only empty lines: nothing to do, and that is no error.
    path.write_text("\n\n")
    run = await _run("forget", "--kind", "bad", "--file", str(path), env=env)
    assert _forgot(_ok(run)) == (0, 0, 0)


async def test_forget_and_prune_fail_with_exit_1_when_they_cannot(
    redis_url: str, pg_url: str
) -> None:
    await _save(redis_url, pg_url, "cf", ["a"])
    # Approximate (Bloom) mode cannot erase a value: exit 1, nothing deleted.
    approximate = _env(redis_url, pg_url, DEDUP_APPROXIMATE_VALUES="10000")
    run = await _run("forget", "--kind", "cf", "a", env=approximate)
    _refused(run, 1, "dedup: error:")
    run = await _run("prune", "--kind", "cf", "--older-than", "1s", env=approximate)
    _refused(run, 1, "dedup: error:")
    assert await _values(pg_url, "cf") == {"a"}
    # A database nobody listens on: Unavailable, exit 1, no password in the message.
    port = free_port()  # nothing listens there
    down = _env(redis_url, f"postgresql://postgres:hunter2pw@127.0.0.1:{port}/nowhere")
    for args in (("forget", "--kind", "cf", "a"), ("prune", "--kind", "cf", "--older-than", "1d")):
        run = await _run(*args, env=down)
        stderr = _refused(run, 1, "dedup: error:")
        assert "hunter2pw" not in stderr and run.stdout == ""


# ----------------------------------------------------------------------------- prune


async def test_prune_deletes_old_rows_only(redis_url: str, pg_url: str) -> None:
    old = [f"old-{i}" for i in range(25)]
    recent = [f"recent-{i}" for i in range(5)]
    new = [f"new-{i}" for i in range(5)]
    await _save(redis_url, pg_url, "p", [*old, *recent, *new])
    await _save(redis_url, pg_url, "p.other", old)
    await _age(pg_url, "p", old, days=40)
    await _age(pg_url, "p", recent, days=20)
    await _age(pg_url, "p.other", old, days=40)  # old, but of another kind
    env = _env(redis_url, pg_url)

    run = await _run("prune", "--kind", "p", "--older-than", "30d", "--batch-size", "7", env=env)
    assert _pruned(_ok(run), "p", 30 * 86400.0) == len(old)
    # Not a terminal: no progress bar. The audit log names the kind and digests only.
    assert "\r" not in run.stderr and "%" not in run.stderr, run.stderr
    assert "dedup.audit" in run.stderr and digest(old[0]).hex() in run.stderr, run.stderr
    assert "old-" not in run.stderr and "recent-" not in run.stderr
    assert await _values(pg_url, "p") == {*recent, *new}
    assert await _values(pg_url, "p.other") == set(old)
    # The pruned values are forgotten in Redis too: they save anew; the others do not.
    assert await _save(redis_url, pg_url, "p", [old[0], old[-1], new[0]]) == [True, True, False]

    run = await _run("prune", "--kind", "p", "--older-than", "30d", env=env)
    assert _pruned(_ok(run), "p", 30 * 86400.0) == 0  # nothing old is left
    run = await _run("prune", "--kind", "p", "--older-than", "12h", env=env)
    assert _pruned(_ok(run), "p", 12 * 3600.0) == len(recent)
    assert await _values(pg_url, "p") == {old[0], old[-1], *new}


async def test_prune_progress_ctrl_c_and_resume(redis_url: str, pg_url: str) -> None:
    """On a terminal: a progress bar on stderr. Ctrl-C stops it with exit 130, saying it
    can be run again; the same command then deletes the rows left."""
    total = 5_000
    conn = await asyncpg.connect(pg_url, timeout=DEADLINE_S)
    try:
        values = [f"bulk-{i}" for i in range(total)]
        await conn.execute(
            "INSERT INTO dedup_items (kind, digest, value, created_at) "
            "SELECT 'bulk', d, v, now() - interval '40 days' "
            "FROM unnest($1::bytea[], $2::text[]) AS t (d, v)",
            [digest(v) for v in values],
            values,
        )
    finally:
        await conn.close()
    env = _env(redis_url, pg_url)
    argv = ["prune", "--kind", "bulk", "--older-than", "30d"]

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dedup", *argv, "--batch-size", "10"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
        )
        os.close(slave)
        slave = -1
        with proc:  # its pipe closed and the process reaped, whatever happens
            try:
                seen = await asyncio.to_thread(_read_until_progress, master, f"/{total:,}")
                proc.send_signal(signal.SIGINT)
                # The terminal is read until the child closes it: a child whose writes to
                # a full terminal blocked would never get to handle the Ctrl-C.
                reader = asyncio.ensure_future(asyncio.to_thread(_read_rest, master))
                try:
                    stdout, _ = await asyncio.to_thread(proc.communicate, None, RUN_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()  # its terminal closes: the reader returns what it read
                    seen += await reader
                    raise AssertionError(
                        f"dedup prune still ran {RUN_TIMEOUT_S} s after Ctrl-C (a progress "
                        f"bar that went on: the cancel was lost); its terminal: {seen[-3000:]!r}"
                    ) from None
                seen += await reader
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert proc.returncode == 130, (proc.returncode, stdout, seen)
    assert "Traceback" not in seen, seen
    assert "rows/s" in seen and "%" in seen, seen
    assert "run the same command again to resume" in seen, seen
    assert stdout == ""
    left = len(await _values(pg_url, "bulk"))
    assert 0 < left < total, left

    run = await _run(*argv, env=env)
    assert _pruned(_ok(run), "bulk", 30 * 86400.0) == left
    assert await _values(pg_url, "bulk") == set()


_PROGRESS = re.compile(r"([0-9][0-9,]*)/")


def _read_until_progress(fd: int, marker: str) -> str:
    """What the terminal got, up to a progress line showing more than 0 rows done."""
    deadline = time.monotonic() + DEADLINE_S
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child exited and closed the terminal
            break
        if not chunk:
            break
        seen += chunk.decode(errors="replace")
        for line in seen.split("\r"):
            match = _PROGRESS.search(line)
            if marker in line and match and int(match[1].replace(",", "")) > 0:
                return seen
    raise AssertionError(f"no progress within {DEADLINE_S} s: {seen!r}")


def _read_rest(fd: int) -> str:
    """What is left to read on the terminal, until the child exits and closes it (or
    RUN_TIMEOUT_S passed)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return seen
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: no process holds the terminal any more
            return seen
        if not chunk:
            return seen
        seen += chunk.decode(errors="replace")
    return seen


def test_progress_bar_clears_its_line_for_a_log_record() -> None:
    out, clock = _Terminal(), _Clock()
    bar = ProgressBar(out, clock=clock)
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with bar.attached():
            bar(1, 10)
            logging.getLogger("dedup.audit").warning("forgot values of kind 'k'")
            bar(2, 10)  # drawn at once after the record, however soon
        logging.getLogger("dedup.audit").warning("after")  # detached: no clearing
    finally:
        root.removeHandler(handler)
    text = out.getvalue()
    assert "1/10" in text and "\r\x1b[Kforgot values of kind 'k'\n\r[" in text, repr(text)
    assert "2/10" in text and text.endswith("rows/safter\n")  # detached: not cleared
    assert text.count("\x1b[K") == 1
