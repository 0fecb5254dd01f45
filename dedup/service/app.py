"""The HTTP ingest service behind ``dedup serve``: the aiohttp app, its handlers, and
the serving loop of one worker process.

One :class:`~dedup.Gateway` per worker process, served by aiohttp with orjson:

- ``POST /v1/save`` one item -> 201 created / 200 duplicate, ``{"created", "source"}``;
- ``POST /v1/save/batch`` ``{"items": [...]}`` -> ``{"results": [...]}`` in order,
  validated whole before any work (:meth:`Gateway.save_many`);
- ``GET /healthz``, ``GET /readyz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``.

A 200 or 201 is sent only after :meth:`Gateway.save` returned, that is once the row
is committed; every other answer acknowledges nothing. Every 4xx and 5xx has the
body ``{"error": {"code", "message"}}`` (see :data:`dedup.service.openapi.ERRORS`).

On SIGTERM a worker stops accepting, finishes the requests in flight, then closes
its Gateway, which waits for the saves still in flight, so no lease stays held; the
whole drain is bounded by ``drain_timeout_s``.

The rest of the service lives beside it: metrics in :mod:`dedup.service.metrics`,
the processes (one worker, or a supervisor of several) in :mod:`dedup.service.supervisor`,
and ``dedup check`` in :mod:`dedup.cli.check`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from dedup import __version__
from dedup.errors import DedupError, InvalidInput, Overloaded, Unavailable, WaitTimeout
from dedup.gateway import Gateway
from dedup.service.logs import setup_logging
from dedup.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dedup.service.metrics import PUSH_INTERVAL_S, ServiceMetrics
from dedup.service.openapi import (
    BATCH_PATH,
    CODE_FOR_STATUS,
    HEALTHZ_PATH,
    METRICS_PATH,
    OPENAPI_PATH,
    PATHS,
    PROTECTED_PATHS,
    READYZ_PATH,
    SAVE_PATH,
    SOURCES,
    openapi_document,
)
from dedup.service.settings import ServiceSettings
from dedup.types import Item, SaveResult
from dedup.urls import redact

__all__ = ["HEARTBEAT_INTERVAL_S", "create_app", "serve", "setup_logging"]

log = logging.getLogger("dedup.service")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

HEARTBEAT_INTERVAL_S = 1.0
"""How often a served event loop calls ``serve``'s ``heartbeat``."""

_ITEM_FIELDS = frozenset(("kind", "value", "payload"))
_JSON = "application/json"

# The five possible answers, encoded once: the hot path only picks one.
_RESULT_BODIES: dict[str, bytes] = {
    source: orjson.dumps({"created": source == "write", "source": source}) for source in SOURCES
}


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
    route = path if path in PATHS else "other"
    started = time.perf_counter()
    response: web.StreamResponse
    try:
        if (
            state.token is not None
            and path in PROTECTED_PATHS
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
        code = CODE_FOR_STATUS.get(exc.status, "http_error")
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

# Request bodies are read as sent (``auto_decompress=False`` on the app): aiohttp's own
# decompression fails on a broken gzip or deflate body with an error that escapes the
# handler (a 500), and again, as an "Unhandled exception" traceback in the log, when it
# drains the unread body of any other answer (a 401, say). Nothing documents compressed
# requests, so a Content-Encoding other than identity is refused with 415 before reading.
_IDENTITY = frozenset(("", "identity"))

# orjson reads an integer beyond the 64-bit range (-2**63 .. 2**64-1) as a float, that
# is rounded. Such a literal has at least 19 digits; only a body with a run that long
# is parsed again, so that the payload encoder sees the exact int and refuses it.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _is_json(request: web.Request) -> bool:
    charset = (request.charset or "utf-8").lower()
    return request.content_type == _JSON and charset in ("utf-8", "utf8")


def _is_identity(request: web.Request) -> bool:
    return all(
        coding.strip().lower() in _IDENTITY
        for header in request.headers.getall("Content-Encoding", ())
        for coding in header.split(",")
    )


async def _read_json(request: web.Request, state: _State) -> Any:
    """The request's JSON body, or the 415 / 413 / 400 that says why not."""
    if request.headers.get("Content-Type") not in _JSON_TYPES and not _is_json(request):
        raise _ApiError(
            415, "unsupported_media_type", "Content-Type must be application/json (UTF-8)"
        )
    if "Content-Encoding" in request.headers and not _is_identity(request):
        raise _ApiError(
            415,
            "unsupported_media_type",
            "Content-Encoding must be identity: compressed bodies are not accepted",
            headers={"Accept-Encoding": "identity"},
        )
    limit = state.settings.max_body_bytes
    length = request.content_length
    try:
        if length is not None and length > limit:
            raise web.HTTPRequestEntityTooLarge(limit, length)  # refused without reading it
        body = await request.read()  # aiohttp enforces client_max_size on chunked bodies
    except web.HTTPRequestEntityTooLarge:
        raise _ApiError(413, "body_too_large", f"the body is over {limit} bytes") from None
    except web.RequestPayloadError:
        # The body's encoding broke midway (possible where the serving aiohttp decodes
        # bodies, as when this app is mounted in another): the client's fault, not a bug.
        raise _ApiError(400, "malformed_json", "the body could not be read") from None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None
    if _LONG_DIGITS.search(body) is None:
        return data
    # orjson has validated the body (UTF-8, no lone surrogates, no NaN), so json reads
    # the same document, its integers exact. json recurses and gives up about 1000
    # levels deep; orjson's parse is then kept, as the answer is 422 either way: nesting
    # that deep is refused wherever it is (in a payload by its encoder, which stops at
    # 254 levels; anywhere else by the checks of the body's shape).
    try:
        return json.loads(body.decode())
    except RecursionError:
        return data


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
    state.metrics.batch(len(items))
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
    gateway = state.gateway
    ready = {"ready": True, "degraded": gateway.degraded, "checks": checks}
    if gateway.degraded:
        ready["reason"] = gateway.degraded_reason  # unreachable, oom, readonly or misconf
    return web.Response(
        body=orjson.dumps(ready),
        content_type=_JSON,
    )


async def _metrics(request: web.Request) -> web.Response:
    state = _state(request)
    gw = state.gateway
    body = state.metrics.render(
        gw.stats(), pending=gw.pending, degraded=gw.degraded, reason=gw.degraded_reason
    )
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def _openapi(request: web.Request) -> web.Response:
    return web.Response(body=_state(request).openapi, content_type=_JSON)


async def _gateway_lifetime(app: web.Application) -> AsyncIterator[None]:
    """Open the Gateway before serving; close it after the last request finished.

    Meanwhile a task pushes the metrics' deltas about once a second; the last push
    comes after the Gateway closed, so the saves finished while draining count too.
    """
    state = app[_STATE]
    gateway = state.gateway
    await gateway.open()
    pusher = asyncio.create_task(_push_metrics(state), name="dedup-metrics-push")
    try:
        yield
        remaining = state.settings.drain_timeout_s
        if state.drain_deadline is not None:
            remaining = state.drain_deadline - asyncio.get_running_loop().time()
        # At least a moment: saves of handlers cancelled at the deadline still hold leases.
        await gateway.aclose(drain_timeout_s=max(1.0, remaining))
    finally:
        pusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pusher
        state.metrics.flush(gateway.stats(), pending=0, degraded=False)


async def _push_metrics(state: _State) -> None:
    gateway = state.gateway
    while True:
        await asyncio.sleep(PUSH_INTERVAL_S)
        try:
            state.metrics.flush(
                gateway.stats(),
                pending=gateway.pending,
                degraded=gateway.degraded,
                reason=gateway.degraded_reason,
            )
        except Exception:  # a metrics failure must not end the worker; try again later
            log.exception("pushing the metrics failed")


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
    app = web.Application(
        middlewares=[_middleware],
        client_max_size=settings.max_body_bytes,
        # On the app, not in serve(): any runner of this app gets it too (see _IDENTITY).
        handler_args={"auto_decompress": False},
    )
    app[_STATE] = state
    app.router.add_post(SAVE_PATH, _save)
    app.router.add_post(BATCH_PATH, _save_batch)
    app.router.add_get(HEALTHZ_PATH, _healthz)
    app.router.add_get(READYZ_PATH, _readyz)
    app.router.add_get(METRICS_PATH, _metrics)
    app.router.add_get(OPENAPI_PATH, _openapi)
    app.cleanup_ctx.append(_gateway_lifetime)
    app.on_shutdown.append(_on_shutdown)
    return app


# ---------------------------------------------------------------------------- serving


class _RequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering the requests its HTTP parser refuses (a
    bad request line or header, a line too long, a bad chunk size: no handler or
    middleware of the app sees them) like every other error of the service: a JSON
    body, ``malformed_http``. aiohttp's own answer was a plain-text 400 quoting the
    request's bytes, and an ERROR log line with a traceback quoting them again (an
    over-long ``Authorization`` header put the token in the log)."""

    __slots__ = ()  # a subclass of a slotted class, so that a handler can become one

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not 400 <= status < 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        # The exception's class only: its text quotes the request.
        what = type(exc).__name__ if exc is not None else "a malformed request"
        log.debug("refused a request aiohttp could not parse (%s, %d)", what, status)
        code = "malformed_http" if status == 400 else CODE_FOR_STATUS.get(status, "http_error")
        response = _ApiError(status, code, f"the request is not valid HTTP/1.1 ({what})").response()
        response.force_close()
        # Counted like every response (its path unknown: route "other"); no latency,
        # as no request reached the application.
        metrics = getattr(getattr(self, "_manager", None), "metrics", None)
        if isinstance(metrics, ServiceMetrics):
            metrics.response("other", status, 0.0)
        return response


class _Server(web.Server):
    """aiohttp's protocol factory, making :class:`_RequestHandler` connection handlers."""

    metrics: ServiceMetrics | None = None
    """The application's metrics, where its handlers count the requests they refuse."""

    def __call__(self) -> web.RequestHandler:
        handler = super().__call__()
        if type(handler) is web.RequestHandler:  # else an aiohttp laid out otherwise
            handler.__class__ = _RequestHandler  # same slots: only handle_error differs
        return handler


def _answer_parser_errors_in_json(runner: web.AppRunner, metrics: ServiceMetrics) -> None:
    """Make ``runner``'s server answer unparsable requests with :class:`_RequestHandler`
    and count them in ``metrics`` (aiohttp builds its server and handlers itself, with
    no option for their classes)."""
    server = runner.server
    if type(server) is web.Server:
        server.__class__ = _Server
        assert isinstance(server, _Server)
        server.metrics = metrics
    else:  # an aiohttp laid out otherwise: keep its plain-text answers
        log.warning("aiohttp's server is not the expected class: its parser errors stay plain text")


async def serve(
    gateway: Gateway,
    settings: ServiceSettings,
    *,
    reuse_port: bool = False,
    on_ready: Callable[[int], None] | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> None:
    """Serve ``gateway`` on ``settings.host:port`` until SIGTERM or SIGINT, then drain.

    Draining: stop accepting, let requests in flight finish, then close the Gateway
    (which waits for saves in flight), all within ``drain_timeout_s``; requests
    still running at the deadline are cancelled and acknowledge nothing.
    ``on_ready`` gets the bound port once the socket listens. ``heartbeat`` is called
    every :data:`HEARTBEAT_INTERVAL_S` from the event loop until the end (so it stops
    when the loop is blocked): the supervisor's liveness check.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    beating = None
    if heartbeat is not None:
        beating = asyncio.create_task(_beat(heartbeat), name="dedup-heartbeat")
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
        _answer_parser_errors_in_json(runner, state.metrics)
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
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _beat(heartbeat: Callable[[], None]) -> None:
    while True:
        heartbeat()
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def _bound_port(runner: web.AppRunner, fallback: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return fallback
