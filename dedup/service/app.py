"""The HTTP ingest service behind ``dedup serve``: its requests, its handlers, and the
serving loop of one worker process.

One :class:`~dedup.Gateway` per worker process, served by :mod:`dedup.service.http`
(httptools' parser on the event loop) with orjson:

- ``POST /v1/save`` one item -> 201 created / 200 duplicate, ``{"created", "source"}``;
- ``POST /v1/save/batch`` ``{"items": [...]}`` -> ``{"results": [...]}`` in order,
  validated whole before any work (:meth:`Gateway.save_many`);
- ``POST /v1/forget`` one ``{"kind", "value"}`` -> 200 ``{"forgotten"}``, and
  ``POST /v1/forget/batch`` ``{"items": [...]}`` -> ``{"results": [...]}`` in order
  (:meth:`Gateway.forget`, :meth:`Gateway.forget_many`); 409 ``cannot_forget`` where the
  Gateway cannot erase (:class:`~dedup.errors.CannotForget`);
- ``GET /healthz``, ``GET /readyz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``.

A 200 or 201 is sent only after the Gateway answered, that is once the row is
committed; every other answer acknowledges nothing. Every 4xx and 5xx has the body
``{"error": {"code", "message"}}`` (see :data:`dedup.service.openapi.ERRORS`).

A request is checked in a fixed order: path (404), method (405), token (401),
Content-Type and Content-Encoding (415) and size (413) once its head is read, then
JSON (400) and fields (422) once its body is. A save the Gateway answers from its
local tier is answered from the protocol's callback, with no task; the others wait
in a task of their own.

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
import resource
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from dedup import __version__
from dedup.errors import (
    CannotForget,
    DedupError,
    InvalidInput,
    Overloaded,
    Unavailable,
    WaitTimeout,
)
from dedup.gateway import Gateway
from dedup.service.http import HttpServer, Request, Response
from dedup.service.logs import setup_logging
from dedup.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dedup.service.metrics import PUSH_INTERVAL_S, ServiceMetrics
from dedup.service.openapi import (
    BATCH_PATH,
    FORGET_BATCH_PATH,
    FORGET_PATH,
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
from dedup.service.tracing import configure as configure_tracing
from dedup.service.tracing import continues_a_trace, end_server_span, server_span
from dedup.tracing import active_tracer
from dedup.types import Item, SaveResult
from dedup.urls import redact

__all__ = ["HEARTBEAT_INTERVAL_S", "create_app", "serve", "setup_logging"]

log = logging.getLogger("dedup.service")

HEARTBEAT_INTERVAL_S = 1.0
"""How often a served event loop calls ``serve``'s ``heartbeat``."""

_OWN_FILES = 256  # files a worker keeps besides its clients: pools, logs, the listener
_ITEM_FIELDS = frozenset(("kind", "value", "payload"))
_FORGET_FIELDS = frozenset(("kind", "value"))
_JSON = "application/json"

# Every success answer, made once: the hot path only picks one.
_RESULT_BODIES: dict[str, bytes] = {
    source: orjson.dumps({"created": source == "write", "source": source}) for source in SOURCES
}
_RESULTS: dict[str, Response] = {
    source: Response(201 if source == "write" else 200, body)
    for source, body in _RESULT_BODIES.items()
}

# A forget's two answers, made once too.
_FORGET_BODIES: dict[bool, bytes] = {
    done: orjson.dumps({"forgotten": done}) for done in (True, False)
}
_FORGET_RESULTS: dict[bool, Response] = {
    done: Response(200, body) for done, body in _FORGET_BODIES.items()
}

_Answer = Response | Coroutine[Any, Any, Response]
_Handler = Callable[[Request], _Answer]


# ----------------------------------------------------------------------------- errors


class _ApiError(Exception):
    """An answer other than success, raised anywhere in the handling of a request."""

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
        self.headers = tuple((headers or {}).items())
        self.extra = extra

    def response(self) -> Response:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        error.update(self.extra)
        return Response(self.status, orjson.dumps({"error": error}), headers=self.headers)


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


def _authorized(request: Request, token: bytes) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    # compare_digest: the time taken must not reveal how much of the token matched.
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token)


@dataclass(frozen=True, slots=True)
class _Route:
    """One path: its handlers by method, whether it needs the token, its Allow header,
    and whether its body is a JSON document."""

    handlers: Mapping[str, _Handler]
    protected: bool
    allow: str
    json_body: bool


class _Service:
    """The service's requests over one Gateway: routing, auth, the handlers, JSON errors
    for every failure and the response metrics (the :class:`~dedup.service.http.Handler`
    of :class:`~dedup.service.http.HttpServer`)."""

    def __init__(self, gateway: Gateway, settings: ServiceSettings) -> None:
        self.gateway = gateway
        self.settings = settings
        self.max_body_bytes = settings.max_body_bytes
        self.metrics = ServiceMetrics()
        self.token = settings.auth_token.encode() or None
        self.retry_after = {"Retry-After": str(settings.retry_after_s)}
        self.openapi = orjson.dumps(
            openapi_document(
                max_batch_items=settings.max_batch_items,
                max_body_bytes=settings.max_body_bytes,
                auth=self.token is not None,
                version=__version__,
            )
        )
        self.log = _RateLimitedLog()
        self.draining = False
        self.drain_deadline: float | None = None
        self._healthz: Response | None = None
        gets = (
            (HEALTHZ_PATH, self._get_healthz),
            (READYZ_PATH, self._get_readyz),
            (METRICS_PATH, self._get_metrics),
            (OPENAPI_PATH, self._get_openapi),
        )
        posts = (
            (SAVE_PATH, self._save),
            (BATCH_PATH, self._save_batch),
            (FORGET_PATH, self._forget),
            (FORGET_BATCH_PATH, self._forget_batch),
        )
        self._routes: dict[str, _Route] = {}
        for path, get in gets:  # HEAD answers as GET, without the body
            protected = path in PROTECTED_PATHS
            self._routes[path] = _Route({"GET": get, "HEAD": get}, protected, "GET,HEAD", False)
        for path, post in posts:
            self._routes[path] = _Route({"POST": post}, path in PROTECTED_PATHS, "POST", True)
        assert set(self._routes) == set(PATHS)

    # -------------------------------------------------------- the server's calls

    def head(self, request: Request) -> Response | None:
        """The answer decided by the request's head (404, 405, 401, 415, 413), if any;
        else its handler, left in ``request.route``."""
        route = self._routes.get(request.path)
        try:
            if route is None:
                raise _ApiError(404, "not_found", "Not Found")
            handler = route.handlers.get(request.method)
            if handler is None:
                raise _ApiError(
                    405, "method_not_allowed", "Method Not Allowed", headers={"Allow": route.allow}
                )
            # Unknown paths and methods answer 404/405 first: they reveal nothing.
            if route.protected and self.token is not None and not _authorized(request, self.token):
                raise _ApiError(
                    401,
                    "unauthorized",
                    "a bearer token is required (Authorization: Bearer <token>)",
                    headers={"WWW-Authenticate": 'Bearer realm="dedup"'},
                )
            if route.json_body:
                _check_json_head(request, self.max_body_bytes)
        except _ApiError as exc:
            return self._count(request.path if route else "other", request, exc.response())
        request.route = handler
        return None

    def handle(self, request: Request) -> Response | Awaitable[Response]:
        """The answer, at once where the handler has it, else a coroutine that waits."""
        try:
            answer = request.route(request)
        except _ApiError as exc:
            answer = exc.response()
        except Exception:
            log.exception("internal error answering %s %s", request.method, request.path)
            answer = _internal_error()
        if type(answer) is Response:
            return self._count(request.path, request, answer)
        return self._finish(request, answer)

    def refuse(self, status: int, code: str, message: str) -> Response:
        """The answer to a request the HTTP server refused (counted, its path unknown)."""
        response = _ApiError(status, code, message).response()
        self.metrics.response("other", status, 0.0)
        return response

    def connection_refused(self) -> None:
        """Count a connection closed at accept (``max_connections`` were open)."""
        self.metrics.connections_refused += 1

    async def _finish(self, request: Request, answer: Coroutine[Any, Any, Response]) -> Response:
        tracer = active_tracer()
        if tracer is None or not continues_a_trace(request.headers):
            return self._count(request.path, request, await self._settle(request, answer))
        # The request's span is current while its handler waits: the Gateway's spans are
        # its children (this runs in the request's own task, whose context it changes).
        from opentelemetry.trace import use_span

        span = server_span(tracer, request, request.path)
        with use_span(span, record_exception=False, set_status_on_exception=False):
            response = await self._settle(request, answer)
        return self._count(request.path, request, response, span)

    async def _settle(self, request: Request, answer: Coroutine[Any, Any, Response]) -> Response:
        try:
            return await answer
        except _ApiError as exc:
            return exc.response()
        except Exception:
            log.exception("internal error answering %s %s", request.method, request.path)
            return _internal_error()

    def _count(
        self, route: str, request: Request, response: Response, span: Any = None
    ) -> Response:
        """Count ``response`` under ``route`` (a known path: :meth:`handle` only gets the
        requests :meth:`head` routed; else ``"other"``), and end the request's span
        (``span``, begun before its handler waited; else made now, while tracing)."""
        self.metrics.response(route, response.status, time.perf_counter() - request.started)
        if span is not None:
            end_server_span(span, request, response)
        else:
            tracer = active_tracer()  # tracing off: this check is all a request pays
            if tracer is not None and continues_a_trace(request.headers):
                known = None if route == "other" else route
                end_server_span(server_span(tracer, request, known), request, response)
        return response

    # ------------------------------------------------------------------- handlers

    def _save(self, request: Request) -> _Answer:
        kind, value, payload = _item(_read_json(request), None)
        try:
            begun = self.gateway._save_begin(kind, value, payload)
        except DedupError as exc:
            raise _from_dedup(exc, self) from None
        if type(begun) is SaveResult:  # answered by the local tier: no task
            self.metrics.items += 1
            return _RESULTS[begun.source]
        return self._save_slow(begun)

    async def _save_slow(self, begun: Any) -> Response:
        try:
            result = await self.gateway._save_finish(begun)
        except DedupError as exc:
            raise _from_dedup(exc, self) from None
        self.metrics.items += 1
        return _RESULTS[result.source]

    def _batch_items(self, request: Request) -> list[Any]:
        """The ``items`` array of a batch body, checked for shape and the item limit."""
        data = _read_json(request)
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
        limit = self.settings.max_batch_items
        if len(raw) > limit:
            raise _invalid(
                f"items has {len(raw)} entries, over the limit of {limit}", field="items"
            )
        return raw

    def _save_batch(self, request: Request) -> _Answer:
        raw = self._batch_items(request)
        items: list[Item] = []
        for index, obj in enumerate(raw):
            kind, value, payload = _item(obj, index)
            items.append((kind, value) if payload is None else (kind, value, payload))
        self.metrics.batch(len(items))
        return self._save_many(items)

    async def _save_many(self, items: list[Item]) -> Response:
        try:
            results: list[SaveResult] = await self.gateway.save_many(items)
        except DedupError as exc:
            raise _from_dedup(exc, self) from None
        self.metrics.items += len(results)
        body = b'{"results":[' + b",".join(_RESULT_BODIES[r.source] for r in results) + b"]}"
        return Response(200, body)

    def _forget(self, request: Request) -> _Answer:
        kind, value = _forget_item(_read_json(request), None)
        return self._forget_one(kind, value)

    async def _forget_one(self, kind: Any, value: Any) -> Response:
        try:
            forgotten = await self.gateway.forget(kind, value)
        except DedupError as exc:
            raise _from_dedup(exc, self) from None
        self.metrics.forgets(1, int(forgotten))
        return _FORGET_RESULTS[bool(forgotten)]

    def _forget_batch(self, request: Request) -> _Answer:
        raw = self._batch_items(request)
        items = [_forget_item(obj, index) for index, obj in enumerate(raw)]
        return self._forget_many(items)

    async def _forget_many(self, items: list[tuple[Any, Any]]) -> Response:
        try:
            results: list[bool] = await self.gateway.forget_many(items)
        except DedupError as exc:
            raise _from_dedup(exc, self) from None
        self.metrics.forgets(len(results), sum(map(bool, results)))
        body = b'{"results":[' + b",".join(_FORGET_BODIES[bool(r)] for r in results) + b"]}"
        return Response(200, body)

    def _get_healthz(self, request: Request) -> _Answer:
        if self._healthz is None:  # made in the serving process (a worker), not before
            self._healthz = Response(200, orjson.dumps({"status": "ok", "pid": os.getpid()}))
        return self._healthz

    async def _get_readyz(self, request: Request) -> Response:
        if self.draining:
            raise _ApiError(
                503,
                "not_ready",
                "draining: this process is shutting down",
                headers=self.retry_after,
            )
        checks = await self.gateway.ping(timeout_s=self.settings.ready_timeout_s)
        # Without Redis the gateway still serves (degraded, through the database's unique
        # key); without the database it cannot acknowledge anything.
        if not checks["database"]:
            down = ", ".join(name for name, up in checks.items() if not up)
            raise _ApiError(
                503,
                "not_ready",
                f"cannot reach: {down}",
                headers=self.retry_after,
                checks=checks,
            )
        gateway = self.gateway
        ready = {"ready": True, "degraded": gateway.degraded, "checks": checks}
        if gateway.degraded:
            ready["reason"] = gateway.degraded_reason  # unreachable, oom, readonly or misconf
        return Response(200, orjson.dumps(ready))

    def _get_metrics(self, request: Request) -> _Answer:
        gw = self.gateway
        body = self.metrics.render(
            gw.stats(), pending=gw.pending, degraded=gw.degraded, reason=gw.degraded_reason
        )
        return Response(200, body, content_type=METRICS_CONTENT_TYPE)

    def _get_openapi(self, request: Request) -> _Answer:
        return Response(200, self.openapi)

    # ------------------------------------------------------------------- lifetime

    @contextlib.asynccontextmanager
    async def lifetime(self) -> AsyncIterator[None]:
        """Open the Gateway before serving; close it after the last request finished.

        Meanwhile a task pushes the metrics' deltas about once a second; the last push
        comes after the Gateway closed, so the saves finished while draining count too.
        """
        gateway = self.gateway
        await gateway.open()
        pusher = asyncio.create_task(self._push_metrics(), name="dedup-metrics-push")
        try:
            yield
            remaining = self.settings.drain_timeout_s
            if self.drain_deadline is not None:
                remaining = self.drain_deadline - asyncio.get_running_loop().time()
            # At least a moment: saves of handlers cancelled at the deadline still hold leases.
            await gateway.aclose(drain_timeout_s=max(1.0, remaining))
        finally:
            pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pusher
            self.metrics.flush(gateway.stats(), pending=0, degraded=False)

    async def _push_metrics(self) -> None:
        gateway = self.gateway
        while True:
            await asyncio.sleep(PUSH_INTERVAL_S)
            try:
                self.metrics.flush(
                    gateway.stats(),
                    pending=gateway.pending,
                    degraded=gateway.degraded,
                    reason=gateway.degraded_reason,
                )
            except Exception:  # a metrics failure must not end the worker; try again later
                log.exception("pushing the metrics failed")


def _internal_error() -> Response:
    return _ApiError(500, "internal_error", "internal error; nothing was acknowledged").response()


# ------------------------------------------------------------------------ requests

# The usual spellings of a JSON content type, accepted without parsing the header.
_JSON_TYPES = frozenset(("application/json", "application/json; charset=utf-8"))
_UTF8 = frozenset(("utf-8", "utf8"))

# Request bodies are read as sent: nothing documents compressed requests (and a broken
# or oversized compressed body must not reach a decompressor), so a Content-Encoding
# other than identity is refused with 415 before the body is read.
_IDENTITY = frozenset(("", "identity"))

# orjson reads an integer beyond the 64-bit range (-2**63 .. 2**64-1) as a float, that
# is rounded. Such a literal has at least 19 digits; only a body with a run that long
# is parsed again, so that the payload encoder sees the exact int and refuses it.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _is_json(content_type: str) -> bool:
    """``application/json``, with no charset or a UTF-8 one (any case, any spacing)."""
    media, *params = content_type.split(";")
    if media.strip().lower() != _JSON:
        return False
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in _UTF8:
            return False
    return True


def _check_json_head(request: Request, limit: int) -> None:
    """The 415 or 413 a JSON request's head earns, if any."""
    headers = request.headers
    content_type = headers.get("content-type", "")
    if content_type not in _JSON_TYPES and not _is_json(content_type):
        raise _ApiError(
            415, "unsupported_media_type", "Content-Type must be application/json (UTF-8)"
        )
    encoding = headers.get("content-encoding")
    if encoding is not None and not all(
        coding.strip().lower() in _IDENTITY for coding in encoding.split(",")
    ):
        raise _ApiError(
            415,
            "unsupported_media_type",
            "Content-Encoding must be identity: compressed bodies are not accepted",
            headers={"Accept-Encoding": "identity"},
        )
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _ApiError(413, "body_too_large", f"the body is over {limit} bytes")


def _read_json(request: Request) -> Any:
    """The request's JSON body, or the 400 that says why not."""
    body = request.body
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


def _fields(obj: Any, index: int | None, fields: frozenset[str], expected: str) -> dict[str, Any]:
    """One item object, checked for its shape: a JSON object of ``fields`` only (named in
    order in ``expected``), with ``kind`` and ``value``; the Gateway checks their types
    and sizes."""
    if type(obj) is not dict:
        what = "the body" if index is None else "each item"
        raise _invalid(f"{what} must be a JSON object", field=None, index=index)
    if not obj.keys() <= fields:
        unknown = sorted(set(obj) - fields)[0]
        raise _invalid(
            f"unknown field {unknown!r} (expected {expected})", field=unknown, index=index
        )
    for name in ("kind", "value"):
        if name not in obj:
            raise _invalid(f"{name} is required", field=name, index=index)
    return obj


def _item(obj: Any, index: int | None) -> tuple[Any, Any, Any]:
    """(kind, value, payload) of one save object."""
    obj = _fields(obj, index, _ITEM_FIELDS, "kind, value, payload")
    return obj["kind"], obj["value"], obj.get("payload")


def _forget_item(obj: Any, index: int | None) -> tuple[Any, Any]:
    """(kind, value) of one forget object."""
    obj = _fields(obj, index, _FORGET_FIELDS, "kind, value")
    return obj["kind"], obj["value"]


def _from_dedup(exc: DedupError, service: _Service) -> _ApiError:
    """The HTTP answer for a Gateway error; details of server failures go to the log only."""
    retry = service.retry_after
    if isinstance(exc, InvalidInput):
        extra: dict[str, Any] = {"field": exc.field}
        if exc.index is not None:
            extra["index"] = exc.index
        return _ApiError(422, "invalid_input", str(exc), **extra)
    if isinstance(exc, CannotForget):
        return _ApiError(
            409,
            "cannot_forget",
            "this gateway cannot erase values (approximate/Bloom mode or a custom sink); "
            "nothing was deleted",
        )
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
        service.log.warning(exc.component, redact(str(exc)))
        return _ApiError(
            503,
            "unavailable",
            f"the {exc.component} cannot be reached; nothing was acknowledged, retry later",
            headers=retry,
            component=exc.component,
        )
    service.log.warning("other", redact(str(exc)))
    return _ApiError(
        503, "unavailable", "the service cannot save now; nothing was acknowledged", headers=retry
    )


# ------------------------------------------------------------------- embedding


def create_app(gateway: Gateway, settings: ServiceSettings) -> web.Application:
    """An aiohttp application serving ``gateway`` as ``dedup serve`` does (not yet open:
    the app opens it at startup and closes it at cleanup, after the last request), to
    mount in an aiohttp server of your own. :func:`serve` answers the same requests the
    same way on the service's own HTTP server (:mod:`dedup.service.http`), which costs
    a request far less than aiohttp's."""
    service = _Service(gateway, settings)

    async def handle(request: web.Request) -> web.Response:
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            key = name.lower()
            headers[key] = value if key not in headers else f"{headers[key]}, {value}"
        ours = Request(request.method, request.raw_path.encode(), headers, request.remote or "-")
        answer = service.head(ours)
        if answer is None:
            try:
                ours.body = await request.read()  # aiohttp enforces client_max_size
            except web.HTTPRequestEntityTooLarge:
                limit = settings.max_body_bytes
                answer = service.refuse(413, "body_too_large", f"the body is over {limit} bytes")
            except web.RequestPayloadError:
                answer = service.refuse(400, "malformed_json", "the body could not be read")
            else:
                handled = service.handle(ours)
                answer = handled if isinstance(handled, Response) else await handled
        return web.Response(
            body=answer.body,
            status=answer.status,
            headers={"Content-Type": answer.content_type, **dict(answer.headers)},
        )

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        async with service.lifetime():
            yield

    async def on_shutdown(app: web.Application) -> None:
        service.draining = True

    app = web.Application(
        client_max_size=settings.max_body_bytes,
        # Bodies as sent: a compressed one is refused (415) before it is read.
        handler_args={"auto_decompress": False},
    )
    # One route for every path and method: the service routes (and answers 404/405) itself.
    app.router.add_route("*", "/{path:.*}", handle)
    app.cleanup_ctx.append(lifetime)
    app.on_shutdown.append(on_shutdown)
    return app


# ---------------------------------------------------------------------------- serving


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
    # Tracing from the OTEL_* variables (dedup[otel]); each worker sets up its own.
    stop_tracing = configure_tracing()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    beating = None
    if heartbeat is not None:
        beating = asyncio.create_task(_beat(heartbeat), name="dedup-heartbeat")
    service = _Service(gateway, settings)
    _raise_open_files_limit(settings.max_connections)
    server = HttpServer(
        service,
        limits=settings.limits(),
        # One line per request: no headers or bodies, so the token and values stay out.
        access_log=settings.access_log,
    )
    try:
        # Opens the Gateway: fails here if Redis or the database cannot be reached.
        async with service.lifetime():
            try:
                port = await server.start(
                    settings.host, settings.port, reuse_port=reuse_port, backlog=settings.backlog
                )
                log.info(
                    "serving on http://%s:%d (pid %d, auth %s)",
                    settings.host,
                    port,
                    os.getpid(),
                    "on" if service.token else "off",
                )
                if not settings.loopback and service.token is None:
                    log.warning(
                        "listening on %s without auth_token: anyone who can reach it can write",
                        settings.host,
                    )
                if on_ready is not None:
                    on_ready(port)
                await stop.wait()
                log.info("draining (pid %d): finishing requests in flight", os.getpid())
            finally:
                service.draining = True
                service.drain_deadline = loop.time() + settings.drain_timeout_s
                await server.drain(settings.drain_timeout_s)
        log.info("stopped (pid %d)", os.getpid())
    finally:
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        for sig in signals:
            loop.remove_signal_handler(sig)
        if stop_tracing is not None:
            stop_tracing()  # exports what is still batched (bounded by the exporter's timeout)


def _raise_open_files_limit(connections: int) -> None:
    """Lift this process's soft limit on open files toward the hard one, so that
    ``connections`` clients (and the pools' own sockets) fit: past the limit, accept()
    fails and asyncio stops accepting for a while, for every client."""
    needed = connections + _OWN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft < needed:
        log.warning(
            "the open files limit (%d) is below max_connections (%d) plus %d of the "
            "service's own: raise it (ulimit -n) or lower max_connections",
            soft,
            connections,
            _OWN_FILES,
        )


async def _beat(heartbeat: Callable[[], None]) -> None:
    while True:
        heartbeat()
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)
