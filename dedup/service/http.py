"""The HTTP/1.1 server under ``dedup serve``: httptools' parser (llhttp, Node.js's
parser, in C) on an asyncio protocol, with no task, router or response object per
request where the answer is ready at once.

Why its own: the service's requests are small and answered in microseconds (a repeat
is one lookup in the Gateway's local tier), so a general server's work per request
(aiohttp: a task, a request and a response object, a middleware chain; about 30 µs)
was most of the request. Here a request whose handler answers synchronously is
parsed, handled and written from ``data_received`` itself; only a handler that must
wait (a new value goes to Redis and the database) gets a task.

What it does, and what a client sees:

- HTTP/1.1 keep-alive (HTTP/1.0 with ``Connection: keep-alive``), pipelined requests
  answered in order; ``Expect: 100-continue`` answered before a body is read;
- every request it refuses itself (unparsable, a request line or header over
  :data:`MAX_LINE_BYTES`, over :data:`MAX_HEADERS` headers, a body over the handler's
  limit) gets the handler's JSON error (:meth:`Handler.refuse`) and the connection is
  closed; nothing of the request is quoted or logged;
- idle connections are closed after ``keepalive_timeout_s``;
- :meth:`HttpServer.drain` stops accepting, closes idle connections, lets the
  requests in flight finish (each answered with ``Connection: close``), and cancels
  what still runs at the deadline.

The handler (:class:`Handler`) sees each request twice: :meth:`Handler.head` once
its head is read (it may answer at once, e.g. 404, 401 or 413 before the body is
read), and :meth:`Handler.handle` once the body is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import time
from collections import deque
from collections.abc import Awaitable
from email.utils import formatdate
from typing import Any, Protocol

import httptools

__all__ = [
    "MAX_HEADERS",
    "MAX_LINE_BYTES",
    "Handler",
    "HttpServer",
    "Request",
    "Response",
]

log = logging.getLogger("dedup.service")
access_log = logging.getLogger("dedup.access")

MAX_LINE_BYTES = 8190
"""The longest request target, and the longest header (name and value), in bytes."""
MAX_HEADERS = 128
"""The most header lines a request may have."""
_MAX_PIPELINED = 32  # requests parsed ahead of the one being answered: then reading pauses
_LINGER_S = 2.0  # after a last answer, how long what the client still sends is read and dropped


class Request:
    """One request: ``method`` (upper case), ``path`` (as sent, without the query),
    ``query`` (after ``?``, raw), ``headers`` (names in lower case; repeated fields joined
    with ", "), ``body`` (bytes), ``version`` ("1.1"), and ``remote`` (the peer's address).
    ``route`` is the handler's own: :meth:`Handler.head` may leave there what
    :meth:`Handler.handle` needs."""

    __slots__ = ("body", "headers", "keep_alive", "method", "path", "query", "remote", "route",
                 "started", "version")  # fmt: skip

    def __init__(self, method: str, target: bytes, headers: dict[str, str], remote: str) -> None:
        path, _, query = target.partition(b"?")
        self.method = method
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.headers = headers
        self.body = b""
        self.version = "1.1"
        self.keep_alive = True
        self.remote = remote
        self.route: Any = None
        self.started = time.perf_counter()


class Response:
    """An answer: ``status``, ``body``, ``content_type`` and any ``headers`` besides
    Content-Type, Content-Length, Date and Connection (which the server writes)."""

    __slots__ = ("_date", "_wire", "body", "content_type", "headers", "status")

    def __init__(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers
        # The whole keep-alive answer as sent, and the Date it was made with: a response
        # the handler answers often (a save's result, /healthz) is made once a second.
        self._date = b""
        self._wire = b""

    def wire(self, date: bytes, connection: bytes = b"", head: bool = False) -> bytes:
        """The bytes to send: status line, headers (``connection``: a Connection header
        line, or none), the blank line and, unless ``head``, the body."""
        if not connection and not head and date is self._date:
            return self._wire
        parts = [
            _status_line(self.status),
            b"Content-Type: ",
            self.content_type.encode("latin-1"),
            b"\r\nContent-Length: ",
            str(len(self.body)).encode(),
            b"\r\nDate: ",
            date,
            b"\r\n",
        ]
        for name, value in self.headers:
            parts.append(f"{name}: {value}\r\n".encode("latin-1"))
        parts.append(connection)
        parts.append(b"\r\n")
        if not head:
            parts.append(self.body)
        wire = b"".join(parts)
        if not connection and not head:
            self._date, self._wire = date, wire
        return wire


class Handler(Protocol):
    """What the server calls; :class:`dedup.service.app` implements it."""

    max_body_bytes: int
    """A body over this many bytes is refused with :meth:`refuse` (413)."""

    def head(self, request: Request) -> Response | None:
        """Called once the request's head is read (``body`` still empty): an answer to
        send without reading the body, or None to read it and call :meth:`handle`."""

    def handle(self, request: Request) -> Response | Awaitable[Response]:
        """The answer, at once or awaited (then in a task of its own)."""

    def refuse(self, status: int, code: str, message: str) -> Response:
        """The answer to a request the server refuses itself (a 400 ``malformed_http``
        or a 413 ``body_too_large``); counted by the handler like any answer."""


class _Refused(Exception):
    """Raised in a parser callback to stop parsing: the request is refused (with
    ``response`` where its answer was decided already)."""

    def __init__(
        self, status: int, code: str, message: str, response: Response | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.response = response


_STATUS_LINES: dict[int, bytes] = {
    status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()
    for status in http.HTTPStatus
}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Unknown\r\n".encode()


class _Clock:
    """The Date header's value, formatted once a second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = 0
        self._value = b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


class _Connection(asyncio.Protocol):
    """One client connection: parses its requests and writes their answers in order."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._handler = server.handler
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._remote = "-"
        # The request being parsed.
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._request: Request | None = None
        self._early: Response | None = None  # the answer decided at its head
        # Parsed requests not answered yet, oldest first (the first may be running).
        self._queue: deque[tuple[Request, Response | None]] = deque()
        self._running: asyncio.Task[None] | None = None
        self._refusal: Response | None = None  # sent after the running request's answer
        self._paused = False
        self._closing = False
        self.last_active = time.monotonic()

    # ---------------------------------------------------------------- transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self._transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self._remote = str(peer[0])
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._closing = True
        self._queue.clear()
        # A request still running goes on (its save commits as it would have); its answer
        # has nowhere to go and is dropped.

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self.last_active = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused.status, refused.code, refused.message, refused.response)
            else:  # a bug of the server's own: no traceback quotes the request
                log.error("HTTP parser callback failed (%s)", type(refused).__name__)
                self._refuse(500, "internal_error", "internal error; nothing was acknowledged")
            return
        except httptools.HttpParserUpgrade:
            self._refuse(400, "malformed_http", "the request is not valid HTTP/1.1 (Upgrade)")
            return
        except httptools.HttpParserError as exc:
            what = type(exc).__name__  # its text may quote the request
            self._refuse(400, "malformed_http", f"the request is not valid HTTP/1.1 ({what})")
            return
        self._answer_queued()

    def _refuse(
        self, status: int, code: str, message: str, response: Response | None = None
    ) -> None:
        """Answer what was queued before, then this refusal, then close."""
        self._closing = True
        if response is None:
            response = self._handler.refuse(status, code, message)
        self._refusal = response  # sent by _answer_queued once the queue is answered
        self._answer_queued()

    # ---------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._header_count = 0
        self._body = []
        self._body_size = 0
        self._request = None
        self._early = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE_BYTES:
            raise _Refused(
                400, "malformed_http", "the request is not valid HTTP/1.1 (URL too long)"
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > MAX_HEADERS:
            raise _Refused(
                400, "malformed_http", "the request is not valid HTTP/1.1 (too many headers)"
            )
        if len(name) + len(value) > MAX_LINE_BYTES:
            raise _Refused(
                400, "malformed_http", "the request is not valid HTTP/1.1 (header too long)"
            )
        key = name.decode("latin-1").lower()
        # As aiohttp reads them: a token or type in UTF-8 compares as the text it is.
        text = value.decode("utf-8", "surrogateescape")
        known = self._headers.get(key)
        self._headers[key] = text if known is None else f"{known}, {text}"

    def on_headers_complete(self) -> None:
        parser = self._parser
        request = Request(
            parser.get_method().decode("ascii"), self._url, self._headers, self._remote
        )
        request.version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        self._request = request
        self._early = self._handler.head(request)
        expects = request.headers.get("expect", "").lower() == "100-continue"
        if expects and self._early is not None:
            # The client waits for a 100 before it sends the body: answer now (after the
            # requests before it) and close, as the body will not come.
            raise _Refused(self._early.status, "", "", self._early)
        if expects and self._early is None and not self._queue and self._transport is not None:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        limit = self._handler.max_body_bytes
        if self._body_size > limit:
            # Not read further: the connection closes after the answer (the one decided
            # at the head, else a 413).
            early = self._early
            if early is not None:
                raise _Refused(early.status, "", "", early)
            raise _Refused(413, "body_too_large", f"the body is over {limit} bytes")
        if self._early is None:
            self._body.append(body)

    def on_message_complete(self) -> None:
        request = self._request
        assert request is not None
        if self._early is None and self._body:
            request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._queue.append((request, self._early))
        self._request = None
        self._url = b""  # else the connection never counts as idle again
        if len(self._queue) >= _MAX_PIPELINED and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    # ------------------------------------------------------------------ answers

    def _answer_queued(self) -> None:
        """Answer the queued requests in order, at once while their answers are ready."""
        queue = self._queue
        while queue and self._running is None and not self._closing_done():
            request, early = queue[0]
            if early is not None:
                queue.popleft()
                self._send(early, request=request)
                continue
            try:
                answer = self._handler.handle(request)
            except Exception:
                log.exception("internal error answering %s", request.method)
                answer = self._handler.refuse(
                    500, "internal_error", "internal error; nothing was acknowledged"
                )
            if isinstance(answer, Response):
                queue.popleft()
                self._send(answer, request=request)
            else:
                self._running = self._server.loop.create_task(self._await(request, answer))
        if self._paused and len(queue) < _MAX_PIPELINED // 2 and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        refusal = self._refusal
        if refusal is not None and not queue and self._running is None:
            self._refusal = None
            self._send(refusal, keep_alive=False)

    async def _await(self, request: Request, answer: Awaitable[Response]) -> None:
        try:
            response = await answer
        except Exception:  # as in _answer_queued: a 500, and the requests behind it go on
            log.exception("internal error answering %s", request.method)
            response = self._handler.refuse(
                500, "internal_error", "internal error; nothing was acknowledged"
            )
        finally:
            self._running = None
        if self._queue and self._queue[0][0] is request:
            self._queue.popleft()
        self._send(response, request=request)
        self._answer_queued()

    def _closing_done(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def _send(
        self, response: Response, *, request: Request | None = None, keep_alive: bool = True
    ) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if request is not None:
            keep_alive = keep_alive and request.keep_alive and not self._server.draining
        connection = b""
        if not keep_alive:
            connection = b"Connection: close\r\n"
        elif request is not None and request.version == "1.0":
            connection = b"Connection: keep-alive\r\n"
        head = request is not None and request.method == "HEAD"
        transport.write(response.wire(self._server.clock.date(), connection, head))
        self.last_active = time.monotonic()
        if (
            request is not None
            and access_log.isEnabledFor(logging.INFO)
            and self._server.access_log
        ):
            access_log.info(
                '%s "%s %s HTTP/%s" %d %d %.6f',
                request.remote,
                request.method,
                request.path,
                request.version,
                response.status,
                len(response.body),
                time.perf_counter() - request.started,
            )
        if not keep_alive:
            self._closing = True
            self._linger(transport)

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close after the last answer without losing it: shut the sending side (the
        client reads the answer, then the end), read and drop what the client still
        sends (the rest of a refused body) until it closes or :data:`_LINGER_S` passed.
        Closed at once, the socket would answer those bytes with a reset, which can
        reach the client before it read the answer."""
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._server.loop.call_later(_LINGER_S, transport.close)

    # ------------------------------------------------------------------- server

    @property
    def idle(self) -> bool:
        """No request is being parsed, queued or answered."""
        return self._running is None and not self._queue and self._request is None and not self._url

    def close(self) -> None:
        """Close now (only called on an idle connection, or at the drain's deadline, where
        the request still running is cancelled: it acknowledges nothing)."""
        self._closing = True
        if self._running is not None:
            self._running.cancel()
        if self._transport is not None:
            self._transport.close()


class HttpServer:
    """The listening socket and its connections; see the module's docstring."""

    def __init__(
        self,
        handler: Handler,
        *,
        keepalive_timeout_s: float = 75.0,
        access_log: bool = False,
    ) -> None:
        self.handler = handler
        self.keepalive_timeout_s = keepalive_timeout_s
        self.access_log = access_log
        self.connections: set[_Connection] = set()
        self.clock = _Clock()
        self.draining = False
        self.loop: asyncio.AbstractEventLoop  # set by start()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(
        self, host: str, port: int, *, reuse_port: bool = False, backlog: int = 128
    ) -> int:
        """Listen on ``host:port``; returns the bound port (``port`` 0: a free one)."""
        loop = self.loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_port=reuse_port or None, backlog=backlog
        )
        self._sweeper = asyncio.create_task(self._sweep(), name="dedup-http-idle")
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def _sweep(self) -> None:
        """Close connections idle for longer than the keep-alive timeout, once a second."""
        while True:
            await asyncio.sleep(min(1.0, self.keepalive_timeout_s))
            cutoff = time.monotonic() - self.keepalive_timeout_s
            for connection in list(self.connections):
                if connection.idle and connection.last_active < cutoff:
                    connection.close()

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting, close idle connections, wait (up to ``timeout_s``) for the
        requests in flight to be answered, then close every connection."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + timeout_s
        while True:
            for connection in list(self.connections):
                if connection.idle:
                    connection.close()
            if not self.connections or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.close()  # at the deadline: what still runs acknowledges nothing
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
