"""The service's logging: plain text for a terminal, or one JSON object per line.

``dedup serve --log-format json`` (``DEDUP_LOG_FORMAT=json``) writes every record as
one line of JSON, its traceback included as a field, so that line-based collectors
(journald, Docker, Fluent Bit, Vector) keep each record whole. Every line carries
the process id: several workers share one stream.
"""

from __future__ import annotations

import logging
import sys
import threading
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import orjson

__all__ = ["LOG_FORMATS", "JsonFormatter", "setup_logging"]

LOG_FORMATS = ("text", "json")
"""The values of ``log_format``."""

_HANDLER_NAME = "dedup"
TEXT_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"

# Attributes every LogRecord has; anything else was passed with ``extra=`` and is kept.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (UTC, ISO 8601), ``level``,
    ``logger``, ``pid``, ``message``, then ``exception`` (the formatted traceback) and
    ``stack`` when present, and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        # default=str: an extra field that is not JSON (a Path, say) is written as text.
        return orjson.dumps(entry, default=str).decode()


def _log_uncaught(
    kind: type[BaseException], value: BaseException, traceback: TracebackType | None
) -> None:
    logging.getLogger("dedup").critical("uncaught exception", exc_info=(kind, value, traceback))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or isinstance(args.exc_value, SystemExit):
        return
    logging.getLogger("dedup").critical(
        "uncaught exception in thread %s",
        getattr(args.thread, "name", "?"),
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def setup_logging(level: str, log_format: str = "text") -> None:
    """Log to stderr at ``level``, as text (with the PID) or one JSON object per line.

    Calling it again replaces the handler it added before (rather than adding a
    second stream); handlers added by others are left alone.
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == _HANDLER_NAME:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    if log_format == "json":
        # An exception nobody caught is a record too, not a bare traceback on stderr.
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
    # Alembic narrates every step of the embedded default's migration at INFO.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
