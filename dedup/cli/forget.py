"""``dedup forget`` and ``dedup prune``: erase values, or every row of a kind past an age.

``dedup forget --kind K VALUE...`` (or ``--file PATH``, one value a line, ``-`` for
standard input) reads and checks every value first, then calls
:meth:`dedup.Gateway.forget_many` in chunks of :data:`FORGET_CHUNK`, and prints
``forgot N of M values (K had no row)``. ``dedup prune --kind K --older-than 30d``
calls :meth:`dedup.Gateway.prune`, with a progress bar on stderr when it is a
terminal, and prints ``pruned N rows of kind K older than <cutoff>``.

Exit status: 0 done; 2 bad input (the message names the line or argument, never the
value) or bad settings; 1 when Redis or the database cannot serve, a value stayed
leased too long, or the Gateway cannot erase (approximate mode, a custom sink);
130 on Ctrl-C (what was done stays done: run the command again to finish).
Nothing here prints or logs a value: only counts, line numbers and the kind.

``dedup reconcile`` calls :meth:`dedup.Gateway.reconcile` after a database restore that
the gateways cannot notice by themselves, and prints what it did.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import re
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, TextIO

from dedup._values import Limits, validate_kind, validate_value
from dedup.errors import (
    CannotForget,
    DedupError,
    InvalidInput,
    Overloaded,
    Unavailable,
    WaitTimeout,
)
from dedup.gateway import Gateway
from dedup.loop import run
from dedup.options import GatewayOptions
from dedup.types import Reconciled
from dedup.urls import redact

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "EXIT_INTERRUPTED",
    "FORGET_CHUNK",
    "MAX_OLDER_THAN_S",
    "ProgressBar",
    "forget_command",
    "older_than_arg",
    "parse_duration",
    "positive_int_arg",
    "prune_command",
    "read_values",
    "reconcile_command",
]

FORGET_CHUNK = 10_000
"""Values per :meth:`dedup.Gateway.forget_many` call of ``dedup forget``."""
DEFAULT_BATCH_SIZE = 1000
"""Rows per batch of ``dedup prune`` unless ``--batch-size`` says otherwise."""
MAX_OLDER_THAN_S = 100 * 365 * 86400.0
"""The longest ``--older-than`` accepted: 100 years (a longer one prunes nothing anyway)."""
EXIT_INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT), as shells report it."""

_EXIT_BAD_INPUT = 2
_EXIT_FAILED = 1
# The errors that say "the servers could not do it now, or this gateway never can": exit 1.
_FAILURES = (Unavailable, WaitTimeout, CannotForget, Overloaded)

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)", re.IGNORECASE)


# ----------------------------------------------------------------------------- input


class _BadInput(Exception):
    """Input the command refuses (exit 2); the message names where, never the value."""


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a positive number with an optional unit, ``s`` (seconds, the
    default), ``m`` (minutes), ``h`` (hours) or ``d`` (days): ``30d``, ``12h``, ``90m``,
    ``45s``, ``3600``, ``1.5h``.

    Raises :class:`ValueError` for anything else: zero, a sign, an exponent, ``inf`` or
    ``nan``, spaces inside, several units, or more than :data:`MAX_OLDER_THAN_S`.
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: give a positive number with an optional unit "
            "s, m, h or d (e.g. 30d, 12h, 90m, 45s, 3600)"
        )
    number, unit = match.groups()
    seconds = float(number) * _UNITS[unit.lower() or "s"]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{text!r} is not a duration above zero")
    if seconds > MAX_OLDER_THAN_S:
        raise ValueError(f"{text!r} is over the limit of 100 years ({MAX_OLDER_THAN_S:.0f} s)")
    return seconds


def older_than_arg(text: str) -> float:
    """:func:`parse_duration` as an argparse ``type`` (a bad one exits 2 with the reason)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int_arg(text: str) -> int:
    """An integer of at least 1, as an argparse ``type``."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return number


@dataclass
class _Values:
    """The values to forget and where each came from: ``origin[i]`` is the line number
    (``--file``) or the position among the arguments, both from 1."""

    values: list[str] = field(default_factory=list)
    origin: array[int] = field(default_factory=lambda: array("q"))
    where: str = "line"
    carriage_returns: int = 0

    def name(self, index: int) -> str:
        """``line 12`` or ``value 3``: item ``index``'s place, for messages."""
        return f"{self.where} {self.origin[index]}"


def _lines(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    for number, line in enumerate(stream, start=1):
        yield number, line[:-1] if line.endswith(b"\n") else line


def read_values(stream: BinaryIO) -> tuple[list[str], list[int]]:
    """(values, their line numbers from 1) of a file of one value a line: UTF-8, only
    each line's final ``\\n`` removed (a ``\\r`` before it stays in the value), empty
    lines skipped.

    Raises :class:`ValueError` naming the first line that is not UTF-8.
    """
    try:
        found = _read(stream)
    except _BadInput as exc:
        raise ValueError(str(exc)) from None
    return found.values, found.origin.tolist()


def _read(stream: BinaryIO) -> _Values:
    found = _Values()
    for number, raw in _lines(stream):
        if not raw:
            continue
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadInput(f"line {number}: not valid UTF-8 (byte {exc.start + 1})") from None
        found.values.append(value)
        found.origin.append(number)
        found.carriage_returns += value.endswith("\r")
    return found


def _check(kind: str, found: _Values, limits: Limits) -> None:
    """Every value valid for the Gateway, or :class:`_BadInput` naming the first bad one."""
    try:
        validate_kind(kind)
    except InvalidInput as exc:
        raise _BadInput(f"--kind: {exc}") from None
    for index, value in enumerate(found.values):
        try:
            validate_value(value, limits)
        except InvalidInput as exc:
            raise _BadInput(f"{found.name(index)}: {exc}") from None


def _limits(kwargs: dict[str, Any]) -> Limits:
    options = GatewayOptions(**kwargs)
    return Limits(
        max_value_bytes=options.max_value_bytes, max_payload_bytes=options.max_payload_bytes
    )


def _error(message: str, err: TextIO) -> None:
    print(f"dedup: error: {message}", file=err)


def _failure(exc: DedupError) -> str:
    """A server failure's message, with any URL's password hidden."""
    return redact(str(exc))


# ---------------------------------------------------------------------- progress bar


class ProgressBar:
    """A one-line progress bar (``done/total``, percent, rate) redrawn in place on a
    terminal; the ``progress`` callback of :meth:`dedup.Gateway.prune`. Draws nothing
    unless ``stream`` is a terminal; redraws at most every ``interval_s``, and always
    at the end. While it runs, a log record written to the same stream first clears
    the bar's line (:meth:`attached`), so that the two never share a line."""

    def __init__(
        self,
        stream: TextIO,
        *,
        unit: str = "rows",
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.unit = unit
        self.interval_s = interval_s
        self.done = 0
        self.total = 0
        self.enabled = stream.isatty()
        self._clock = clock
        self._started = clock()
        self._drawn_at: float | None = None

    def __call__(self, done: int, total: int) -> None:
        """Record ``done`` of ``total`` and redraw if it is time."""
        self.done, self.total = done, total
        if not self.enabled:
            return
        now = self._clock()
        if done < total and self._drawn_at is not None and now - self._drawn_at < self.interval_s:
            return
        self._drawn_at = now
        self.stream.write("\r" + self.line(now))
        self.stream.flush()

    def line(self, now: float | None = None) -> str:
        """The bar's text: ``[#####.....] 5,000/10,000  50.0%  1,234 rows/s``."""
        now = self._clock() if now is None else now
        width = 30
        share = 1.0 if self.total <= 0 else min(self.done / self.total, 1.0)
        filled = int(width * share)
        rate = self.done / max(now - self._started, 1e-9)
        return (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done:,}/{self.total:,} "
            f"{share * 100:5.1f}%  {rate:,.0f} {self.unit}/s"
        )

    def clear(self) -> None:
        """Erase the bar's line, if drawn (the next call draws it again at once)."""
        if self.enabled and self._drawn_at is not None:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn_at = None

    def finish(self) -> None:
        """End the bar's line (if one was drawn), so that what follows starts afresh."""
        if self.enabled and self._drawn_at is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn_at = None

    @contextlib.contextmanager
    def attached(self) -> Iterator[ProgressBar]:
        """Within: every log handler of the root logger writing to this bar's stream
        clears the bar's line before it writes a record."""
        if not self.enabled:
            yield self
            return
        bar = self

        class _ClearBar(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                bar.clear()
                return True

        clearing = _ClearBar()
        handlers = [
            h
            for h in logging.getLogger().handlers
            if isinstance(h, logging.StreamHandler) and h.stream is self.stream
        ]
        for handler in handlers:
            handler.addFilter(clearing)
        try:
            yield self
        finally:
            for handler in handlers:
                handler.removeFilter(clearing)


# ---------------------------------------------------------------------------- forget


def _tool(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Gateway options of a command that saves nothing: it never joins the fleet's
    shared writes, where it could be elected the writer of the gateways' rows (and make
    their saves wait on a process busy forgetting, or gone when it ends)."""
    return {**kwargs, "shared_writes": "off"}


class _ForgetBar(ProgressBar):
    """The progress of ``dedup forget``, and how many of its values had a row."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream, unit="values")
        self.forgotten = 0


async def _forget(
    kwargs: dict[str, Any], kind: str, found: _Values, bar: _ForgetBar, chunk: int
) -> None:
    values = found.values
    async with Gateway(**_tool(kwargs)) as gw:
        for start in range(0, len(values), chunk):
            items = [(kind, value) for value in values[start : start + chunk]]
            try:
                results = await gw.forget_many(items)
            except InvalidInput as exc:
                if exc.index is None:
                    raise
                message = str(exc).removeprefix(f"item {exc.index}: ")
                raise _BadInput(f"{found.name(start + exc.index)}: {message}") from None
            bar.forgotten += sum(map(bool, results))
            bar(start + len(results), len(values))


def forget_command(
    kwargs: dict[str, Any],
    *,
    kind: str,
    values: Iterable[str] = (),
    file: str | None = None,
    stdin: BinaryIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    chunk: int = FORGET_CHUNK,
) -> int:
    """``dedup forget``: forget ``values`` (or those of ``file``, ``-`` for ``stdin``) of
    ``kind`` on a Gateway made of ``kwargs``; returns the exit status.

    Every value is read and checked before anything is deleted: bad input (exit 2)
    deletes nothing. A failure midway (exit 1) or Ctrl-C (130) keeps what was done; the
    message says how much, and running the command again is safe. Past one chunk, a
    progress bar shows on ``err`` when it is a terminal.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    given = list(values)
    bar = _ForgetBar(err)
    try:
        if given and file is not None:
            raise _BadInput("give the values as arguments or with --file, not both")
        if file is None:
            if not given:
                raise _BadInput("no values: give VALUE... or --file PATH (- for stdin)")
            found = _Values(given, array("q", range(1, len(given) + 1)), where="value")
        elif file == "-":
            found = _read(stdin if stdin is not None else sys.stdin.buffer)
        else:
            try:
                with open(file, "rb") as stream:
                    found = _read(stream)
            except OSError as exc:
                raise _BadInput(f"--file: cannot read {file}: {exc.strerror}") from None
        _check(kind, found, _limits(kwargs))
        if found.carriage_returns:
            print(
                f"dedup: warning: {found.carriage_returns} value(s) end with a carriage "
                "return, kept as part of the value (a file with CRLF line ends?)",
                file=err,
            )
        bar.enabled = bar.enabled and len(found.values) > chunk
        if found.values:
            with bar.attached():
                run(_forget(kwargs, kind, found, bar, chunk), progress=lambda: bar.done)
    except _BadInput as exc:
        bar.finish()
        _error(str(exc), err)
        return _EXIT_BAD_INPUT
    except _FAILURES as exc:
        bar.finish()
        _error(_failure(exc), err)
        if bar.done:
            print(
                f"dedup: {bar.done} value(s) were answered before the failure "
                f"({bar.forgotten} forgotten); running the command again is safe",
                file=err,
            )
        return _EXIT_FAILED
    except KeyboardInterrupt:
        bar.finish()
        print(
            f"dedup: interrupted after {bar.done} value(s) ({bar.forgotten} forgotten); "
            "run the same command again to finish",
            file=err,
        )
        return EXIT_INTERRUPTED
    bar.finish()
    total = len(found.values)
    absent = total - bar.forgotten
    print(f"forgot {bar.forgotten} of {total} values ({absent} had no row)", file=out)
    return 0


# ----------------------------------------------------------------------------- prune


async def _prune(
    kwargs: dict[str, Any], kind: str, older_than_s: float, batch_size: int, bar: ProgressBar
) -> int:
    async with Gateway(**_tool(kwargs)) as gw:
        pruned: int = await gw.prune(kind, older_than_s, batch_size=batch_size, progress=bar)
    return pruned


def prune_command(
    kwargs: dict[str, Any],
    *,
    kind: str,
    older_than_s: float,
    batch_size: int = DEFAULT_BATCH_SIZE,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``dedup prune``: delete the rows of ``kind`` created more than ``older_than_s``
    ago, in batches of ``batch_size``, on a Gateway made of ``kwargs``; returns the exit
    status. Stopped (Ctrl-C: 130) or failed (1), it keeps what it deleted and says how
    much; the same command resumes with the rows left. A progress bar shows on ``err``
    when it is a terminal."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        validate_kind(kind)
    except InvalidInput as exc:
        _error(f"--kind: {exc}", err)
        return _EXIT_BAD_INPUT
    cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
    bar = ProgressBar(err)
    try:
        with bar.attached():
            pruned = run(
                _prune(kwargs, kind, older_than_s, batch_size, bar), progress=lambda: bar.done
            )
    except InvalidInput as exc:
        bar.finish()
        _error(str(exc), err)
        return _EXIT_BAD_INPUT
    except _FAILURES as exc:
        bar.finish()
        _error(_failure(exc), err)
        if bar.done:
            print(
                f"dedup: {bar.done} row(s) were pruned before the failure; run the same "
                "command again to resume",
                file=err,
            )
        return _EXIT_FAILED
    except KeyboardInterrupt:
        bar.finish()
        print(
            f"dedup: prune interrupted after {bar.done} row(s) of kind {kind}; run the "
            "same command again to resume with the rows left",
            file=err,
        )
        return EXIT_INTERRUPTED
    bar.finish()
    shown = cutoff.isoformat(timespec="seconds")
    print(f"pruned {pruned} rows of kind {kind} older than {shown}", file=out)
    return 0


async def _reconcile(kwargs: dict[str, Any]) -> Reconciled:
    async with Gateway(**_tool(kwargs)) as gw:
        return await gw.reconcile()


def reconcile_command(
    kwargs: dict[str, Any], *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """``dedup reconcile``: reset every marker of the namespace and drain the tombstones
    on a Gateway made of ``kwargs`` (:meth:`dedup.Gateway.reconcile`); returns the exit
    status (1 when Redis or the database cannot serve)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        done = run(_reconcile(kwargs))
    except _FAILURES as exc:
        _error(_failure(exc), err)
        return _EXIT_FAILED
    except KeyboardInterrupt:
        print("dedup: reconcile interrupted; run it again", file=err)
        return EXIT_INTERRUPTED
    print(
        f"reconciled: every marker reset (epoch {done.epoch}), {done.tombstones} "
        f"tombstone(s) drained, {done.swept} old key(s) deleted; each value's next save "
        "goes to the database once",
        file=out,
    )
    return 0
