"""OpenTelemetry spans of the Gateway's calls, once the application has set a tracer provider.

dedup traces as instrumentation libraries do: with the global tracer provider
(``opentelemetry.trace.set_tracer_provider``), and not at all while none is set.
It never imports OpenTelemetry itself: a provider can only have been set by code that
imported ``opentelemetry.trace``, so until that module is loaded :func:`active_tracer`
answers None after one dictionary lookup, and without the API installed (the
``dedup[otel]`` extra) nothing of it is ever loaded.

The spans (attribute names: :data:`KIND` and the others below):

- ``dedup.save``: a save that waited for Redis, the database or a write (sources
  ``redis``, ``db``, ``write``, and ``inflight`` for a save that shared another call's
  flight); ``dedup.kind``, ``dedup.source``, ``dedup.created``, and the semantic
  conventions' ``db.system.name`` of the server that gave the answer. A save answered
  by the local tier makes none: it costs less than a span, and the metrics count it.
- ``dedup.save_many``: one per call; ``dedup.items`` and ``dedup.created_count``.
- ``dedup.forget`` (:meth:`Gateway.forget`, :meth:`Gateway.forget_many`): ``dedup.items``,
  ``dedup.forgotten_count``; ``dedup.prune``: ``dedup.kind``, ``dedup.deleted_count``.

A call that raises ends its span with the status ERROR and the exception recorded
(its message with any URL password hidden). Each span is a child of the span current
in the caller's context: a request's server span in ``dedup serve``.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from dedup.types import SaveResult
from dedup.urls import redact

if TYPE_CHECKING:  # never imported at run time by this module
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "CREATED",
    "CREATED_COUNT",
    "DB_SYSTEM",
    "DELETED_COUNT",
    "FORGOTTEN_COUNT",
    "ITEMS",
    "KIND",
    "SCOPE",
    "SOURCE",
    "active_tracer",
    "record_error",
    "sink_system",
    "span",
    "trace_save",
    "trace_tracer",
]

SCOPE = "dedup"
"""The instrumentation scope of dedup's spans (the tracer's name)."""

KIND = "dedup.kind"
SOURCE = "dedup.source"
CREATED = "dedup.created"
ITEMS = "dedup.items"
CREATED_COUNT = "dedup.created_count"
FORGOTTEN_COUNT = "dedup.forgotten_count"
DELETED_COUNT = "dedup.deleted_count"
DB_SYSTEM = "db.system.name"
"""The semantic conventions' name of the database system that answered."""

_API = "opentelemetry.trace"
# The tracer, once a real provider is set: the global provider cannot be replaced after
# that (set_tracer_provider refuses), so it is looked up once.
_tracer: Tracer | None = None
# opentelemetry.trace once seen loaded, for the quick check of its global provider.
_api: Any = None


class _NeverTraced:
    """Stands for the API once its provider is the no-op one (it cannot change)."""

    _TRACER_PROVIDER = None


def active_tracer() -> Tracer | None:
    """dedup's tracer, or None while no tracer provider is set (or the API is absent).

    Cheap enough for every call that leaves the process, and for every request of the
    service: a global read once a provider is set; before, a lookup in ``sys.modules``
    (the API not loaded) or a read of the API's global provider (loaded, none set)."""
    if _tracer is not None:
        return _tracer
    api = _api
    if api is not None:
        # The API's own global, None until set_tracer_provider: get_tracer_provider()
        # costs about 1 µs (it looks for OTEL_PYTHON_TRACER_PROVIDER in the
        # environment each time), this about 30 ns.
        if api._TRACER_PROVIDER is None:
            return None
    elif _API not in sys.modules:
        return None
    return _lookup()


def _lookup() -> Tracer | None:
    global _api, _tracer
    from opentelemetry import trace

    # Through the public call first: it also loads a provider named by the API's
    # OTEL_PYTHON_TRACER_PROVIDER variable.
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):  # none set yet
        if hasattr(trace, "_TRACER_PROVIDER"):
            _api = trace  # else every check takes this public path
        return None
    if isinstance(provider, trace.NoOpTracerProvider):  # set for good, to trace nothing
        _api = _NeverTraced
        return None
    from dedup import __version__

    global _current_span
    _current_span = trace.get_current_span
    _tracer = provider.get_tracer(SCOPE, __version__)
    return _tracer


def _no_span() -> Span:
    raise AssertionError("set with the tracer")


_current_span: Callable[[], Span] = _no_span  # opentelemetry.trace.get_current_span


def trace_tracer() -> Tracer | None:
    """dedup's tracer while the caller's context holds a span being recorded (the
    application's, or a request's span in ``dedup serve``), else None: dedup's spans
    join the caller's trace and never start one of their own. An untraced or unsampled
    caller pays this check (about 0.3 µs), not a span the sampler would drop (4 µs or
    more with the SDK: the sampler must be asked for every root span)."""
    tracer = active_tracer()
    if tracer is None or not _current_span().is_recording():
        return None
    return tracer


def sink_system(database_url: str | None, custom_sink: bool) -> str | None:
    """The semantic conventions' ``db.system.name`` of a Gateway's sink: ``postgresql``
    or ``sqlite`` (also the embedded default); None for an application's own sink."""
    if custom_sink:
        return None
    if database_url is None or database_url.startswith("sqlite"):
        return "sqlite"
    return "postgresql"


def record_error(span: Span, exc: BaseException) -> None:
    """End ``span`` in error: status ERROR and the exception as an event, its message
    with URL passwords hidden (a server's error may quote its URL)."""
    if not span.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode

    message = redact(str(exc))
    stacktrace = redact("".join(traceback.format_exception(exc)))  # it ends with the message
    span.record_exception(
        exc, attributes={"exception.message": message, "exception.stacktrace": stacktrace}
    )
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {message}"))


@contextmanager
def span(tracer: Tracer, name: str, attributes: dict[str, Any] | None = None) -> Iterator[Span]:
    """A span current for the block (its children's parent), ended after it; an
    exception out of the block ends it in error (:func:`record_error`)."""
    from opentelemetry.trace import use_span

    current = tracer.start_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    )
    with use_span(current, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        try:
            yield current
        except Exception as exc:
            record_error(current, exc)
            raise


async def trace_save(
    tracer: Tracer, kind: str, answer: Awaitable[SaveResult], sink_system: str | None
) -> SaveResult:
    """``await answer`` (a save past the local tier) in a ``dedup.save`` span.
    ``sink_system`` names the database for a ``db`` or ``write`` answer.

    The span is not made current: the save's I/O runs in the engine's own tasks, so
    nothing would run under it (and a save saves the context switch)."""
    current = tracer.start_span(
        "dedup.save", attributes={KIND: kind}, record_exception=False, set_status_on_exception=False
    )
    try:
        result = await answer
    except BaseException as exc:
        if isinstance(exc, Exception):  # not a cancellation: that is no error of the save's
            record_error(current, exc)
        current.end()
        raise
    source = result.source
    current.set_attribute(SOURCE, source)
    current.set_attribute(CREATED, result.created)
    system = "redis" if source == "redis" else sink_system if source != "inflight" else None
    if system is not None:
        current.set_attribute(DB_SYSTEM, system)
    current.end()
    return result
