"""The HTTP ingest service behind ``dedup serve``, and the checks behind ``dedup check``.

One :class:`~dedup.Gateway` per worker process, served by aiohttp with orjson:

- ``POST /v1/save`` one item -> 201 created / 200 duplicate, ``{"created", "source"}``;
- ``POST /v1/save/batch`` ``{"items": [...]}`` -> ``{"results": [...]}`` in order,
  validated whole before any work (:meth:`Gateway.save_many`);
- ``GET /healthz``, ``GET /readyz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``.

A 200 or 201 is sent only after :meth:`Gateway.save` returned, that is once the row
is committed; every other answer acknowledges nothing. Every 4xx and 5xx has the
body ``{"error": {"code", "message"}}`` (see :data:`dedup.openapi.ERROR_CODES`).

Processes: with ``workers == 1`` the service runs in the calling process; with
more, a supervisor spawns that many workers, each binding the same port with
``SO_REUSEPORT`` (the kernel spreads connections over them), restarts one that
crashes, and forwards SIGTERM/SIGINT. On SIGTERM a worker stops accepting,
finishes the requests in flight, then closes its Gateway, which waits for the
saves still in flight, so no lease stays held; the whole drain is bounded by
``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hmac
import importlib.resources
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson
from aiohttp import web

from dedup import __version__
from dedup.errors import (
    ConfigError,
    DedupError,
    InvalidInput,
    Overloaded,
    Unavailable,
    WaitTimeout,
)
from dedup.gateway import Gateway
from dedup.loop import run as run_loop
from dedup.metrics import Stats
from dedup.openapi import openapi_document
from dedup.settings import Config, ServiceSettings
from dedup.types import Item, SaveResult
from dedup.urls import check_url_password, embedded_sqlite_url, redact

__all__ = [
    "Finding",
    "Histogram",
    "ServiceMetrics",
    "check",
    "create_app",
    "run",
    "serve",
    "setup_logging",
]

log = logging.getLogger("dedup.service")

_T = TypeVar("_T")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SAVE_PATH = "/v1/save"
BATCH_PATH = "/v1/save/batch"
_ROUTES = (SAVE_PATH, BATCH_PATH, "/healthz", "/readyz", "/metrics", "/openapi.json")
_PROTECTED = (SAVE_PATH, BATCH_PATH, "/metrics")
_ITEM_FIELDS = frozenset(("kind", "value", "payload"))
_JSON = "application/json"

# The five possible answers, encoded once: the hot path only picks one.
_RESULT_BODIES: dict[str, bytes] = {
    source: orjson.dumps({"created": source == "write", "source": source})
    for source in ("local", "inflight", "redis", "db", "write")
}

LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the request latency histogram, in seconds."""
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
"""Upper bounds of the batch size histogram, in items."""


# ----------------------------------------------------------------------------- errors


class _ApiError(Exception):
    """An answer other than success, raised anywhere below the middleware."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})
        self.extra = extra

    def response(self) -> web.Response:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        error.update(self.extra)
        return web.Response(
            body=orjson.dumps({"error": error}),
            status=self.status,
            content_type=_JSON,
            headers=self.headers,
        )


_HTTP_CODES = {
    400: "malformed_json",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
    429: "overloaded",
    500: "internal_error",
    503: "unavailable",
}


class _RateLimitedLog:
    """Logs one warning per key per interval (an outage must not flood the log)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        skipped = self._suppressed.pop(key, 0)
        self._last[key] = now
        more = f" (and {skipped} more like it)" if skipped else ""
        log.warning("%s%s", message, more)


# ---------------------------------------------------------------------------- metrics


class Histogram:
    """A Prometheus histogram: cumulative buckets with the given upper bounds, sum, count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation (a bucket holds values <= its bound)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The exposition lines of this histogram; ``labels`` like ``route="/x"``."""
        sep = "," if labels else ""
        out = []
        cumulative = 0
        for bound, n in zip((*self.bounds, None), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound is None else _number(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {cumulative}')
        braces = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{braces} {_number(self.sum)}")
        out.append(f"{name}_count{braces} {self.count}")
        return out


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


_STAT_HELP = {
    "redis_round_trips": "Script calls and other commands sent to Redis.",
    "db_statements": "Statements sent to the database sink.",
    "db_rows_sent": "Rows offered to the database (including rows that existed already).",
    "claim_batches": "Claim script calls that succeeded.",
    "write_batches": "Write statements (one per batch of winners).",
    "busy": "Claims answered 'another writer holds it' (each re-checked later).",
    "reclaims": "Winners whose lease was nearly spent and was renewed before writing.",
    "lost_leases": "Rows committed after the lease had passed to someone else.",
    "wait_timeouts": "Saves that waited longer than wait_timeout_s for another writer.",
    "redis_errors": "Redis calls that failed.",
    "db_errors": "Database writes that failed.",
    "overloaded": "Saves refused because too many were in flight (or, degraded, queued too long).",
    "breaker_opens": "Times the circuit opened because Redis failed or stalled (degraded mode).",
    "degraded_answers": "Values answered by a degraded write (Redis skipped); also in write/db.",
}
_SOURCES = ("local", "inflight", "redis", "db", "write")


class ServiceMetrics:
    """What the service counts itself: responses by route and status, latency and batch sizes.

    The Gateway's own counters come from :meth:`Gateway.stats` at render time.
    """

    def __init__(self) -> None:
        self.started = time.time()
        self.responses: dict[tuple[str, int], int] = {}
        self.latency = {path: Histogram(LATENCY_BUCKETS_S) for path in (SAVE_PATH, BATCH_PATH)}
        self.batch_items = Histogram(BATCH_BUCKETS)
        self.items = 0

    def response(self, route: str, status: int, seconds: float) -> None:
        """Count one response of ``route`` (a known path or ``"other"``)."""
        key = (route, status)
        self.responses[key] = self.responses.get(key, 0) + 1
        histogram = self.latency.get(route)
        if histogram is not None:
            histogram.observe(seconds)

    def render(self, stats: Stats, *, pending: int, degraded: bool) -> str:
        """The Prometheus text exposition (format 0.0.4) of this process."""
        out: list[str] = []

        def header(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        header("dedup_http_responses_total", "counter", "HTTP responses by route and status code.")
        for (route, status), n in sorted(self.responses.items()):
            out.append(f'dedup_http_responses_total{{route="{route}",code="{status}"}} {n}')
        header(
            "dedup_http_request_duration_seconds",
            "histogram",
            "Time from the request reaching the application to its response, by route.",
        )
        for route, histogram in self.latency.items():
            out += histogram.lines("dedup_http_request_duration_seconds", f'route="{route}"')
        header("dedup_http_batch_items", "histogram", "Items per accepted batch request.")
        out += self.batch_items.lines("dedup_http_batch_items")
        header("dedup_http_items_total", "counter", "Items accepted for saving (single + batch).")
        out.append(f"dedup_http_items_total {self.items}")

        counters = stats.as_dict()
        header("dedup_answers_total", "counter", "Successful saves by where the answer came from.")
        for source in _SOURCES:
            out.append(f'dedup_answers_total{{source="{source}"}} {counters.pop(source, 0)}')
        for name, value in counters.items():
            metric = f"dedup_{name}_total"
            header(metric, "counter", _STAT_HELP.get(name, f"Gateway counter {name}."))
            out.append(f"{metric} {value}")

        header("dedup_pending", "gauge", "Values in flight in this process.")
        out.append(f"dedup_pending {pending}")
        header(
            "dedup_degraded",
            "gauge",
            "1 while serving through the database alone (Redis down or slow: circuit open).",
        )
        out.append(f"dedup_degraded {int(degraded)}")
        header("process_start_time_seconds", "gauge", "Start time of this process (Unix time).")
        out.append(f"process_start_time_seconds {_number(self.started)}")
        return "\n".join(out) + "\n"


# -------------------------------------------------------------------------------- app


@dataclass(eq=False)
class _State:
    gateway: Gateway
    settings: ServiceSettings
    metrics: ServiceMetrics
    token: bytes | None
    retry_after: dict[str, str]
    openapi: bytes
    log: _RateLimitedLog
    draining: bool = False
    drain_deadline: float | None = None


_STATE = web.AppKey("dedup_state", _State)


def _state(request: web.Request) -> _State:
    return request.app[_STATE]


def _authorized(request: web.Request, token: bytes) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    # compare_digest: the time taken must not reveal how much of the token matched.
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token)


@web.middleware
async def _middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Auth, JSON errors for every failure, and the response metrics."""
    state = _state(request)
    path = request.path
    route = path if path in _ROUTES else "other"
    started = time.perf_counter()
    response: web.StreamResponse
    try:
        if (
            state.token is not None
            and path in _PROTECTED
            # Unknown paths and methods answer 404/405 first: they reveal nothing.
            and request.match_info.http_exception is None
            and not _authorized(request, state.token)
        ):
            raise _ApiError(
                401,
                "unauthorized",
                "a bearer token is required (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": 'Bearer realm="dedup"'},
            )
        response = await handler(request)
    except _ApiError as exc:
        response = exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        code = _HTTP_CODES.get(exc.status, "http_error")
        response = _ApiError(exc.status, code, exc.reason, headers=headers).response()
    except Exception:
        log.exception("internal error answering %s %s", request.method, route)
        response = _ApiError(
            500, "internal_error", "internal error; nothing was acknowledged"
        ).response()
    state.metrics.response(route, response.status, time.perf_counter() - started)
    return response


# The usual spellings of a JSON content type, accepted without aiohttp's header parsing.
_JSON_TYPES = frozenset(("application/json", "application/json; charset=utf-8"))


def _is_json(request: web.Request) -> bool:
    charset = (request.charset or "utf-8").lower()
    return request.content_type == _JSON and charset in ("utf-8", "utf8")


async def _read_json(request: web.Request, state: _State) -> Any:
    """The request's JSON body, or the 415 / 413 / 400 that says why not."""
    if request.headers.get("Content-Type") not in _JSON_TYPES and not _is_json(request):
        raise _ApiError(
            415, "unsupported_media_type", "Content-Type must be application/json (UTF-8)"
        )
    limit = state.settings.max_body_bytes
    length = request.content_length
    try:
        if length is not None and length > limit:
            raise web.HTTPRequestEntityTooLarge(limit, length)  # refused without reading it
        body = await request.read()  # aiohttp enforces client_max_size on chunked bodies
    except web.HTTPRequestEntityTooLarge:
        raise _ApiError(413, "body_too_large", f"the body is over {limit} bytes") from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None


def _invalid(message: str, *, field: str | None, index: int | None = None) -> _ApiError:
    extra: dict[str, Any] = {"field": field}
    if index is not None:
        extra["index"] = index
        message = f"item {index}: {message}"
    return _ApiError(422, "invalid_input", message, **extra)


def _item(obj: Any, index: int | None) -> tuple[Any, Any, Any]:
    """(kind, value, payload) of one item object; the Gateway checks their types and sizes."""
    if type(obj) is not dict:
        what = "the body" if index is None else "each item"
        raise _invalid(f"{what} must be a JSON object", field=None, index=index)
    if len(obj) > 3 or not obj.keys() <= _ITEM_FIELDS:
        unknown = sorted(set(obj) - _ITEM_FIELDS)[0]
        raise _invalid(
            f"unknown field {unknown!r} (expected kind, value, payload)", field=unknown, index=index
        )
    try:
        return obj["kind"], obj["value"], obj.get("payload")
    except KeyError as exc:
        raise _invalid(f"{exc.args[0]} is required", field=exc.args[0], index=index) from None


def _from_dedup(exc: DedupError, state: _State) -> _ApiError:
    """The HTTP answer for a Gateway error; details of server failures go to the log only."""
    retry = state.retry_after
    if isinstance(exc, InvalidInput):
        extra: dict[str, Any] = {"field": exc.field}
        if exc.index is not None:
            extra["index"] = exc.index
        return _ApiError(422, "invalid_input", str(exc), **extra)
    if isinstance(exc, Overloaded):
        return _ApiError(429, "overloaded", "too many saves in flight; retry later", headers=retry)
    if isinstance(exc, WaitTimeout):
        return _ApiError(
            503,
            "wait_timeout",
            "another writer held this value too long; nothing was acknowledged, retry later",
            headers=retry,
        )
    if isinstance(exc, Unavailable):
        # The server's own message may name hosts; redacted, it goes to the log only.
        state.log.warning(exc.component, redact(str(exc)))
        return _ApiError(
            503,
            "unavailable",
            f"the {exc.component} cannot be reached; nothing was acknowledged, retry later",
            headers=retry,
            component=exc.component,
        )
    state.log.warning("other", redact(str(exc)))
    return _ApiError(
        503, "unavailable", "the service cannot save now; nothing was acknowledged", headers=retry
    )


async def _save(request: web.Request) -> web.Response:
    state = _state(request)
    kind, value, payload = _item(await _read_json(request, state), None)
    try:
        result = await state.gateway.save(kind, value, payload)
    except DedupError as exc:
        raise _from_dedup(exc, state) from None
    state.metrics.items += 1
    status = 201 if result.created else 200
    return web.Response(body=_RESULT_BODIES[result.source], status=status, content_type=_JSON)


async def _save_batch(request: web.Request) -> web.Response:
    state = _state(request)
    data = await _read_json(request, state)
    if type(data) is not dict:
        raise _invalid('the body must be a JSON object {"items": [...]}', field=None)
    if data.keys() != {"items"}:
        extra = sorted(set(data) - {"items"})
        if extra:
            raise _invalid(f"unknown field {extra[0]!r} (expected items)", field=extra[0])
        raise _invalid("items is required", field="items")
    raw = data["items"]
    if type(raw) is not list:
        raise _invalid("items must be a JSON array", field="items")
    limit = state.settings.max_batch_items
    if len(raw) > limit:
        raise _invalid(f"items has {len(raw)} entries, over the limit of {limit}", field="items")
    items: list[Item] = []
    for index, obj in enumerate(raw):
        kind, value, payload = _item(obj, index)
        items.append((kind, value) if payload is None else (kind, value, payload))
    state.metrics.batch_items.observe(len(items))
    try:
        results: list[SaveResult] = await state.gateway.save_many(items)
    except DedupError as exc:
        raise _from_dedup(exc, state) from None
    state.metrics.items += len(results)
    body = b'{"results":[' + b",".join(_RESULT_BODIES[r.source] for r in results) + b"]}"
    return web.Response(body=body, content_type=_JSON)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps({"status": "ok", "pid": os.getpid()}), content_type=_JSON)


async def _readyz(request: web.Request) -> web.Response:
    state = _state(request)
    if state.draining:
        raise _ApiError(
            503, "not_ready", "draining: this process is shutting down", headers=state.retry_after
        )
    checks = await state.gateway.ping(timeout_s=state.settings.ready_timeout_s)
    # Without Redis the gateway still serves (degraded, through the database's unique
    # key); without the database it cannot acknowledge anything.
    if not checks["database"]:
        down = ", ".join(name for name, up in checks.items() if not up)
        raise _ApiError(
            503,
            "not_ready",
            f"cannot reach: {down}",
            headers=state.retry_after,
            checks=checks,
        )
    degraded = state.gateway.degraded
    return web.Response(
        body=orjson.dumps({"ready": True, "degraded": degraded, "checks": checks}),
        content_type=_JSON,
    )


async def _metrics(request: web.Request) -> web.Response:
    state = _state(request)
    gw = state.gateway
    text = state.metrics.render(gw.stats(), pending=gw.pending, degraded=gw.degraded)
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def _openapi(request: web.Request) -> web.Response:
    return web.Response(body=_state(request).openapi, content_type=_JSON)


async def _gateway_lifetime(app: web.Application) -> AsyncIterator[None]:
    """Open the Gateway before serving; close it after the last request finished."""
    state = app[_STATE]
    await state.gateway.open()
    yield
    remaining = state.settings.drain_timeout_s
    if state.drain_deadline is not None:
        remaining = state.drain_deadline - asyncio.get_running_loop().time()
    # At least a moment: saves of handlers cancelled at the deadline still hold leases.
    await state.gateway.aclose(drain_timeout_s=max(1.0, remaining))


async def _on_shutdown(app: web.Application) -> None:
    app[_STATE].draining = True


def create_app(gateway: Gateway, settings: ServiceSettings) -> web.Application:
    """The aiohttp application serving ``gateway`` (not yet open: the app opens it at
    startup and closes it at cleanup, after the last request).

    Embed it in your own aiohttp server, or run it with :func:`serve`.
    """
    token = settings.auth_token.encode() or None
    state = _State(
        gateway=gateway,
        settings=settings,
        metrics=ServiceMetrics(),
        token=token,
        retry_after={"Retry-After": str(settings.retry_after_s)},
        openapi=orjson.dumps(
            openapi_document(
                max_batch_items=settings.max_batch_items,
                max_body_bytes=settings.max_body_bytes,
                auth=token is not None,
                version=__version__,
            )
        ),
        log=_RateLimitedLog(),
    )
    app = web.Application(middlewares=[_middleware], client_max_size=settings.max_body_bytes)
    app[_STATE] = state
    app.router.add_post(SAVE_PATH, _save)
    app.router.add_post(BATCH_PATH, _save_batch)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.cleanup_ctx.append(_gateway_lifetime)
    app.on_shutdown.append(_on_shutdown)
    return app


# ---------------------------------------------------------------------------- serving


async def serve(
    gateway: Gateway,
    settings: ServiceSettings,
    *,
    reuse_port: bool = False,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Serve ``gateway`` on ``settings.host:port`` until SIGTERM or SIGINT, then drain.

    Draining: stop accepting, let requests in flight finish, then close the Gateway
    (which waits for saves in flight), all within ``drain_timeout_s``; requests
    still running at the deadline are cancelled and acknowledge nothing.
    ``on_ready`` gets the bound port once the socket listens.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    app = create_app(gateway, settings)
    state = app[_STATE]
    access_log = logging.getLogger("aiohttp.access") if settings.access_log else None
    runner = web.AppRunner(
        app,
        access_log=access_log,
        # No headers or bodies in the access log: the token and values stay out of it.
        access_log_format='%a "%r" %s %b %Tf',
        shutdown_timeout=settings.drain_timeout_s,
        keepalive_timeout=settings.keepalive_timeout_s,
    )
    try:
        await runner.setup()  # opens the Gateway: fails here if Redis or the database cannot
        try:
            site = web.TCPSite(
                runner,
                settings.host,
                settings.port,
                reuse_port=reuse_port,
                backlog=settings.backlog,
            )
            await site.start()
            port = _bound_port(runner, settings.port)
            log.info(
                "serving on http://%s:%d (pid %d, auth %s)",
                settings.host,
                port,
                os.getpid(),
                "on" if state.token else "off",
            )
            if not settings.loopback and state.token is None:
                log.warning("listening on %s without auth_token: anyone who can reach it can write",
                            settings.host)  # fmt: skip
            if on_ready is not None:
                on_ready(port)
            await stop.wait()
            log.info("draining (pid %d): finishing requests in flight", os.getpid())
        finally:
            state.draining = True
            state.drain_deadline = loop.time() + settings.drain_timeout_s
            await runner.cleanup()
            log.info("stopped (pid %d)", os.getpid())
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _bound_port(runner: web.AppRunner, fallback: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return fallback


def setup_logging(level: str) -> None:
    """Log to stderr with the PID (several workers share one stream)."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Alembic narrates every step of the embedded default's migration at INFO.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.getLogger().level))


def run(settings: ServiceSettings, gateway_kwargs: Mapping[str, Any]) -> int:
    """Run the service until SIGTERM/SIGINT; returns the exit status.

    One worker runs here; more are spawned and supervised. A configuration or
    connection problem at startup raises :class:`DedupError` (one worker) or
    ends the run with the failing worker's status (several).
    """
    embedded = not gateway_kwargs.get("redis_url") or not (
        gateway_kwargs.get("database_url") or gateway_kwargs.get("sink")
    )
    if settings.workers > 1 and embedded:
        raise ConfigError(
            "workers > 1 needs redis_url and database_url (DEDUP_REDIS_URL, DEDUP_DATABASE_URL): "
            "the embedded default belongs to one process"
        )
    if settings.workers == 1:
        gateway = Gateway(**gateway_kwargs)  # checks the options before anything starts
        run_loop(serve(gateway, settings))
        return 0
    Gateway(**gateway_kwargs)  # the same early check, before any worker is spawned
    return _Supervisor(settings, dict(gateway_kwargs)).run()


def _worker_main(
    index: int,
    settings: ServiceSettings,
    gateway_kwargs: dict[str, Any],
    ready: multiprocessing.connection.Connection,
) -> None:
    """Entry point of one spawned worker: serve until signalled, exit 0 (2 on a startup error)."""
    setup_logging(settings.log_level)

    def on_ready(port: int) -> None:
        ready.send(port)
        ready.close()

    try:
        run_loop(serve(Gateway(**gateway_kwargs), settings, reuse_port=True, on_ready=on_ready))
    except DedupError as exc:
        print(f"dedup: worker {index}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:  # a Ctrl-C before the signal handlers were installed
        sys.exit(130)


# Exit statuses of a worker that was told to stop (a signal before its handlers were set
# kills it, a Ctrl-C during its imports exits 130): all clean.
_STOPPED = (0, -signal.SIGTERM, -signal.SIGINT, 130)


class _Supervisor:
    """Spawns the workers, restarts one that crashes, forwards SIGTERM/SIGINT, reaps them."""

    MAX_RESTARTS = 5
    RESTART_WINDOW_S = 60.0
    START_TIMEOUT_S = 120.0

    def __init__(self, settings: ServiceSettings, gateway_kwargs: dict[str, Any]) -> None:
        self._settings = settings
        self._kwargs = gateway_kwargs
        # spawn, not fork: a worker starts clean (no inherited locks, threads or loop).
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: dict[int, Any] = {}
        self._ready: dict[int, multiprocessing.connection.Connection] = {}
        self._stopping = False
        self._restarts: list[float] = []

    def _start(self, index: int) -> None:
        reader, writer = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(index, self._settings, self._kwargs, writer),
            name=f"dedup-worker-{index}",
        )
        proc.start()
        writer.close()  # the child holds its copy; EOF on ours then means it died
        self._workers[index] = proc
        self._ready[index] = reader

    def _signal(self, signum: int, _frame: object) -> None:
        self._stopping = True
        for proc in self._workers.values():
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)

    def run(self) -> int:
        signals = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self._signal) for sig in signals}
        try:
            for index in range(self._settings.workers):
                self._start(index)
            status = self._wait_ready()
            if status == 0:
                log.info(
                    "%d workers serving on http://%s:%d (supervisor pid %d)",
                    self._settings.workers,
                    self._settings.host,
                    self._settings.port,
                    os.getpid(),
                )
                status = self._supervise()
            return self._stop_all(status)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for reader in self._ready.values():
                reader.close()

    def _wait_ready(self) -> int:
        """0 once every worker listens; a failed worker's status otherwise."""
        pending = dict(self._ready)
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while pending and not self._stopping:
            if time.monotonic() > deadline:
                log.error("workers did not start within %.0f s", self.START_TIMEOUT_S)
                return 1
            readable = multiprocessing.connection.wait(list(pending.values()), timeout=0.5)
            for index, conn in list(pending.items()):
                if conn not in readable:
                    continue
                try:
                    conn.recv()
                except EOFError:  # the worker exited before listening
                    if self._stopping:
                        break  # we told it to
                    proc = self._workers[index]
                    proc.join(timeout=10)
                    return proc.exitcode or 1
                del pending[index]
        return 0

    def _supervise(self) -> int:
        while not self._stopping:
            ended = multiprocessing.connection.wait(
                [proc.sentinel for proc in self._workers.values()], timeout=0.5
            )
            for index, proc in list(self._workers.items()):
                if self._stopping:
                    break
                if proc.sentinel not in ended:
                    continue
                proc.join(timeout=1)
                log.error("worker %d (pid %s) exited with %s", index, proc.pid, proc.exitcode)
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if now - t < self.RESTART_WINDOW_S]
                if len(self._restarts) >= self.MAX_RESTARTS:
                    log.error("%d restarts within %.0f s: giving up", len(self._restarts),
                              self.RESTART_WINDOW_S)  # fmt: skip
                    return 1
                self._restarts.append(now)
                self._ready[index].close()
                self._start(index)
        return 0

    def _stop_all(self, status: int) -> int:
        self._signal(signal.SIGTERM, None)
        # Each worker bounds its own drain; the margin covers closing its connections.
        deadline = time.monotonic() + self._settings.drain_timeout_s + 15
        for proc in self._workers.values():
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("worker pid %s did not stop in time: killing it", proc.pid)
                proc.kill()
                proc.join(timeout=10)
                status = status or 1
            elif proc.exitcode not in _STOPPED:
                status = status or proc.exitcode or 1
        return status


# ------------------------------------------------------------------------------ check


@dataclass(frozen=True)
class Finding:
    """One line of ``dedup check``: ``status`` is ok, warn or fail."""

    status: Literal["ok", "warn", "fail"]
    subject: str
    message: str


def _head_revision() -> str | None:
    from alembic.script import ScriptDirectory  # slow to import: only here

    location = Path(str(importlib.resources.files("dedup") / "migrations"))
    return ScriptDirectory(str(location)).get_current_head()


async def _check_redis(url: str, allow_eviction: bool, timeout_s: float) -> list[Finding]:
    from dedup.claims import connect_redis

    shown = redact(url)
    client = connect_redis(url, max_connections=2, timeout_s=timeout_s)
    try:
        memory: Any = await asyncio.wait_for(client.info("memory"), timeout_s * 2)
        server: Any = await asyncio.wait_for(client.info("server"), timeout_s * 2)
    except Exception as exc:
        return [Finding("fail", "redis", f"{shown}: cannot connect: {redact(str(exc))}")]
    finally:
        await client.aclose()

    def per_node(info: Any) -> list[dict[str, Any]]:
        # A cluster answers per node; a single server with one dict.
        if info and isinstance(next(iter(info.values())), dict):
            return list(info.values())
        return [info]

    version = sorted({str(i.get("redis_version", "?")) for i in per_node(server)})
    policies = sorted({str(i.get("maxmemory_policy", "noeviction")) for i in per_node(memory)})
    limits = {int(i.get("maxmemory", 0)) for i in per_node(memory)}
    found = [Finding("ok", "redis", f"{shown}: reachable, Redis {', '.join(version)}")]
    if policies == ["noeviction"]:
        found.append(Finding("ok", "redis", "maxmemory-policy noeviction"))
    else:
        status: Literal["warn", "fail"] = "warn" if allow_eviction else "fail"
        found.append(
            Finding(
                status,
                "redis",
                f"maxmemory-policy {', '.join(policies)}: dedup needs noeviction (leases and "
                "markers carry TTLs, so volatile-* evicts them too)"
                + (" - allowed by allow_eviction" if allow_eviction else ""),
            )
        )
    if 0 in limits:
        found.append(
            Finding(
                "warn",
                "redis",
                "maxmemory is 0 (no limit): Redis can grow until the machine runs out; set it "
                "(with noeviction, a full Redis refuses writes instead of dropping keys)",
            )
        )
    return found


async def _check_postgres(url: str, timeout_s: float) -> list[Finding]:
    import asyncpg

    shown = redact(url)
    try:
        conn = await asyncpg.connect(url, timeout=timeout_s)
    except Exception as exc:
        return [Finding("fail", "database", f"{shown}: cannot connect: {redact(str(exc))}")]
    try:
        version = await conn.fetchval("SHOW server_version")
        fsync = await conn.fetchval("SHOW fsync")
        sync_commit = await conn.fetchval("SHOW synchronous_commit")
        has_table = await conn.fetchval("SELECT to_regclass('dedup_items') IS NOT NULL")
        has_version = await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL")
        revision = (
            await conn.fetchval("SELECT version_num FROM alembic_version") if has_version else None
        )
    except Exception as exc:
        return [Finding("fail", "database", f"{shown}: query failed: {redact(str(exc))}")]
    finally:
        await conn.close(timeout=timeout_s)
    found = [Finding("ok", "database", f"{shown}: reachable, PostgreSQL {version}")]
    if fsync != "on" or sync_commit not in ("on", "remote_apply", "remote_write"):
        found.append(
            Finding(
                "warn",
                "database",
                f"fsync={fsync}, synchronous_commit={sync_commit}: an acknowledged row may be "
                "lost in a crash; keep both on",
            )
        )
    found.append(_schema_finding(bool(has_table), revision))
    return found


def _check_sqlite(url: str) -> list[Finding]:
    from sqlalchemy.engine import make_url

    path = Path(make_url(url).database or "")
    if not path.is_file():
        return [Finding("fail", "database", f"{url}: no such file; run `dedup migrate`")]
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            revision = None
            if "alembic_version" in tables:
                row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
                revision = None if row is None else str(row[0])
    except sqlite3.Error as exc:
        return [Finding("fail", "database", f"{url}: cannot read: {exc}")]
    found = [Finding("ok", "database", f"{url}: readable, SQLite {sqlite3.sqlite_version}")]
    found.append(_schema_finding("dedup_items" in tables, revision))
    return found


def _schema_finding(has_table: bool, revision: str | None) -> Finding:
    head = _head_revision()
    if not has_table:
        return Finding("fail", "database", "no table dedup_items: run `dedup migrate`")
    if revision != head:
        return Finding(
            "fail",
            "database",
            f"schema at revision {revision}, the code needs {head}: run `dedup migrate`",
        )
    return Finding("ok", "database", f"schema at revision {revision} (the newest)")


def _password_ok(url: str) -> bool:
    """False for a URL with an unescaped password: the config finding already fails it, and
    connecting would only quote pieces of the password in the errors."""
    try:
        check_url_password(url, "url")
    except ConfigError:
        return False
    return True


async def check(config: Config) -> list[Finding]:
    """What ``dedup check`` reports: the settings, then Redis and the database as configured.

    Never raises for a problem it finds: each is a ``fail`` finding.
    """
    from dedup.embedded import find_redis_server

    gateway, service = config.gateway, config.service
    found = [
        Finding(
            "ok",
            "config",
            f"read {config.path}" if config.path else "no config file: built-in defaults",
        )
    ]
    kwargs = gateway.gateway_kwargs()
    try:
        Gateway(**kwargs)  # construction checks every option, without any I/O
    except DedupError as exc:
        found.append(Finding("fail", "config", f"[gateway]: {exc}"))
    else:
        found.append(Finding("ok", "config", "[gateway] settings are valid"))
    found.append(
        Finding(
            "ok",
            "config",
            f"[service] will listen on {service.host}:{service.port} with {service.workers} "
            f"worker(s), auth {'on' if service.auth_token else 'off'}",
        )
    )
    if not service.loopback and not service.auth_token:
        found.append(
            Finding(
                "warn",
                "config",
                f"host {service.host} is reachable from other machines and auth_token is empty",
            )
        )
    if service.workers > 1 and not (gateway.redis_url and gateway.database_url):
        found.append(Finding("fail", "config", "workers > 1 needs redis_url and database_url"))

    timeout_s = min(gateway.redis_timeout_s, 5.0)
    if gateway.redis_url:
        if _password_ok(gateway.redis_url):
            found += await _check_redis(gateway.redis_url, gateway.allow_eviction, timeout_s)
    else:
        try:
            binary = find_redis_server()
        except DedupError as exc:
            found.append(Finding("fail", "redis", f"embedded: {exc}"))
        else:
            found.append(
                Finding(
                    "ok",
                    "redis",
                    f"embedded: {binary}, started on a unix socket in {gateway.data_dir} "
                    "(noeviction)",
                )
            )
    url = gateway.database_url
    if not url:
        sqlite_path = embedded_sqlite_url(gateway.data_dir).removeprefix("sqlite:///")
        found.append(
            Finding("ok", "database", f"embedded: SQLite {sqlite_path}, migrated at start")
        )
    elif url.startswith(("postgresql://", "postgres://")) and _password_ok(url):
        found += await _check_postgres(url, 5.0)
    elif url.startswith("sqlite:///"):
        found += await asyncio.to_thread(_check_sqlite, url)
    return found
