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
  answered in order; ``Expect: 100-continue`` answered before a body is read; an
  absolute-form target (``GET http://host/path``) served as its path; ``Upgrade``
  ignored (the request is served as HTTP/1.1);
- every request it refuses itself gets one answer, the handler's JSON error
  (:meth:`Handler.refuse`), and the connection is closed; nothing of the request is
  quoted or logged: unparsable (400 ``malformed_http``), an HTTP/1.1 request without
  exactly one ``Host`` (400), a request target over :data:`MAX_LINE_BYTES` (414), a
  header over :data:`MAX_LINE_BYTES`, over :data:`MAX_HEADERS` headers or a head over
  ``max_head_bytes`` (431), a body over the handler's limit (413), an ``Upgrade``
  request with a body (400), ``CONNECT`` (501), an HTTP version other than 1.x (505),
  a head not whole within ``head_timeout_s`` or a body that makes no progress for
  ``body_timeout_s`` (408);
- what one client can hold is bounded: reading stops while its answers are unread
  (the transport's write buffer over its high-water mark) and while more than
  :data:`_INBOX_BYTES` of its bytes wait to be parsed; at most :data:`_SLICE_BYTES` are
  parsed ahead of the answers; one read callback does at most :data:`_TURN` steps
  (an answer or a slice parsed), then lets the loop serve the other connections; a
  client that reads none of its answers for ``send_timeout_s`` is cut off;
- at most ``max_connections`` connections: one more is closed at accept (counted,
  :meth:`Handler.connection_refused`);
- idle connections are closed after ``keepalive_timeout_s``; a client that closes its
  sending side still gets the answers to the requests it sent whole;
- :meth:`HttpServer.drain` stops accepting, closes the connections that are owed no
  answer, lets the requests in flight finish (each answered with ``Connection:
  close``; requests pipelined behind them are not answered), and cancels what still
  runs at the deadline.

Requests, answers, the handler's interface and the limits are in
:mod:`dedup.service.messages` (and importable from here). The handler (:class:`Handler`)
sees each request twice: :meth:`Handler.head` once
its head is read (it may answer at once, e.g. 404, 401 or 413 before the body is
read), and :meth:`Handler.handle` once the body is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable
from email.utils import formatdate
from typing import NoReturn

import httptools

from dedup.service.messages import Handler, Limits, Request, Response

__all__ = [
    "MAX_HEADERS",
    "MAX_LINE_BYTES",
    "Handler",
    "HttpServer",
    "Limits",
    "Request",
    "Response",
]

log = logging.getLogger("dedup.service")
access_log = logging.getLogger("dedup.access")

MAX_LINE_BYTES = 8190
"""The longest request target, and the longest header (name and value), in bytes."""
MAX_HEADERS = 128
"""The most header lines a request may have."""
_SLICE_BYTES = 4096  # parsed at a time, and only once every request before is answered
_INBOX_BYTES = 65536  # received but not parsed yet: over this, reading pauses
_TURN = 16  # answers and slices parsed per callback, before the other connections' turn
_LINGER_S = 2.0  # after a last answer, how long what the client still sends is read and dropped

# Where the request being received is.
_IDLE, _HEAD, _BODY = 0, 1, 2


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


def _malformed(what: str) -> _Refused:
    return _Refused(400, "malformed_http", f"the request is not valid HTTP/1.1 ({what})")


def _too_large(what: str) -> _Refused:
    return _Refused(431, "headers_too_large", f"the request's {what}")


class _Clock:
    """The Date header's value (``value``), made once a second by a timer on the loop
    rather than read from the system clock for every answer."""

    __slots__ = ("_timer", "now", "value")

    def __init__(self) -> None:
        self.value = b""
        self.now = 0.0
        """``time.perf_counter()`` at the last tick: a connection's last activity, to
        the second, at no cost per request."""
        self._timer: asyncio.TimerHandle | None = None
        self.tick()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Keep ``value`` current on ``loop``, a little after each second begins."""
        self.tick()
        now = time.time()
        self._timer = loop.call_later(1.0 - now % 1.0 + 0.001, self._next, loop)

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        self.start(loop)

    def tick(self) -> None:
        self.value = formatdate(int(time.time()), usegmt=True).encode()
        self.now = time.perf_counter()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Connection(asyncio.Protocol):
    """One client connection: parses its requests and writes their answers in order.

    Its life: requests are parsed (a slice at a time, only while nothing is owed
    before them), answered in order, and written while the client reads; ``_last`` is
    set once nothing more will be parsed (a request that ends the connection, a
    refusal, the peer gone), ``_sent_last`` once nothing more will be written."""

    # Slots: thousands of these live in a worker (an idle one costs about 1 KB less),
    # and the parser's callbacks read their attributes for every request.
    __slots__ = ("_begun", "_body", "_body_size", "_early", "_eof", "_handler", "_head_bytes",
                 "_header_count", "_headers", "_inbox", "_last", "_limits", "_max_head_bytes",
                 "_parser", "_queue", "_read_paused", "_refusal", "_remote", "_request",
                 "_running", "_scheduled", "_sent_last", "_server", "_state", "_transport",
                 "_url", "_watched", "_watched_at", "_write_paused", "_write_paused_at",
                 "last_active")  # fmt: skip

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._handler = server.handler
        self._limits = server.limits
        self._max_head_bytes = server.limits.max_head_bytes
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._remote = "-"
        # The request being parsed.
        self._state = _IDLE
        self._begun = 0.0  # when its head began (perf_counter)
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._request: Request | None = None
        self._early: Response | None = None  # the answer decided at its head
        # Received, not parsed yet (parsed once the requests before are answered).
        self._inbox: memoryview | None = None
        # Parsed requests not answered yet, oldest first (the first may be running).
        self._queue: deque[tuple[Request, Response | None]] = deque()
        self._running: asyncio.Task[None] | None = None
        self._refusal: Response | None = None  # sent after the requests before it
        self._scheduled = False  # a _work is due on the loop
        self._write_paused = False
        self._write_paused_at = 0.0
        self._read_paused = False
        self._eof = False  # the client will send nothing more
        self._last = False  # nothing more is parsed
        self._sent_last = False  # nothing more is written
        # The request whose body the sweeper watches, its size then, and since when.
        self._watched: tuple[Request | None, int] = (None, -1)
        self._watched_at = 0.0
        self.last_active = time.perf_counter()

    # ---------------------------------------------------------------- transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        if len(server.connections) >= self._limits.max_connections:
            self._last = self._sent_last = True
            transport.close()
            self._handler.connection_refused()
            return
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self._remote = str(peer[0])
        server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._last = self._sent_last = True
        self._queue.clear()
        self._inbox = None
        # A request still running goes on (its save commits as it would have); its answer
        # has nowhere to go and is dropped.

    def pause_writing(self) -> None:
        # The client reads slower than it asks: answer nothing more, read nothing more.
        self._write_paused = True
        self._write_paused_at = time.perf_counter()
        self._flow()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._restart_head_clock()
        self._work()

    def eof_received(self) -> bool:
        # The client closed its sending side: answer what it sent whole, then close.
        self._eof = True
        if self._owed() or self._inbox is not None:
            return True
        self._last = self._sent_last = True
        return False

    def data_received(self, data: bytes) -> None:
        if self._last:
            return  # after the last request (or a refusal): read and dropped
        inbox = self._inbox
        if inbox is None and not self._queue and len(data) <= _SLICE_BYTES:
            # The usual case: one or a few requests, nothing before them.
            try:
                self._parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
                self._parse_failed(exc, data)
        else:
            self._inbox = memoryview(data if inbox is None else bytes(inbox) + data)
        self._work()

    # ------------------------------------------------------------------ the work

    def _work(self) -> None:
        """Answer what is queued, in order, and parse more once it is answered; at most
        :data:`_TURN` steps, then come back on a later turn of the loop."""
        queue = self._queue
        budget = _TURN
        while not self._sent_last:
            if queue:
                if self._running is not None or self._write_paused:
                    break
                if budget == 0:
                    self._come_back()
                    break
                budget -= 1
                request, early = queue[0]
                if early is not None:
                    queue.popleft()
                    self._send(early, request)
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
                    self._send(answer, request)
                else:  # it must wait: in a task of its own, ahead of the rest
                    self._running = self._server.loop.create_task(self._await(request, answer))
                continue
            if self._refusal is not None:
                if self._running is None and not self._write_paused:
                    refusal, self._refusal = self._refusal, None
                    self._send(refusal, keep_alive=False)
                break
            inbox = self._inbox
            if inbox is None or self._last:
                break
            if budget == 0:
                self._come_back()
                break
            budget -= 1
            self._inbox = inbox[_SLICE_BYTES:] if len(inbox) > _SLICE_BYTES else None
            self._feed(inbox[:_SLICE_BYTES])
        if self._eof and not self._sent_last and not self._owed() and self._inbox is None:
            self._last = self._sent_last = True
            if self._transport is not None:
                self._transport.close()  # after what is buffered is written
        if self._read_paused or self._write_paused or self._inbox is not None:
            self._flow()

    def _come_back(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._server.loop.call_soon(self._work_again)

    def _work_again(self) -> None:
        self._scheduled = False
        self._work()

    def _flow(self) -> None:
        """Read while the client reads its answers and little of its input is waiting."""
        transport = self._transport
        if transport is None or self._sent_last:
            return
        inbox = self._inbox
        hold = self._write_paused or (inbox is not None and len(inbox) > _INBOX_BYTES)
        if hold != self._read_paused:
            self._read_paused = hold
            if hold:
                transport.pause_reading()
            else:
                transport.resume_reading()
                self._restart_head_clock()

    def _owed(self) -> bool:
        """Requests parsed and not answered yet (or a refusal to send)."""
        return bool(self._queue) or self._running is not None or self._refusal is not None

    def _restart_head_clock(self) -> None:
        # A head begun while answers were owed, or while reading was paused, is timed
        # from when the client could send it.
        if self._state == _HEAD:
            self._begun = time.perf_counter()

    def _feed(self, data: bytes | memoryview) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._parse_failed(exc, data)

    def _parse_failed(self, exc: Exception, data: bytes | memoryview) -> None:
        """What the parser raised: a refusal of ours, an Upgrade, or bad HTTP."""
        if isinstance(exc, httptools.HttpParserCallbackError):
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused.status, refused.code, refused.message, refused.response)
            else:  # a bug of the server's own: no traceback quotes the request
                log.error("HTTP parser callback failed (%s)", type(refused).__name__)
                self._refuse(500, "internal_error", "internal error; nothing was acknowledged")
        elif isinstance(exc, httptools.HttpParserUpgrade):
            # The request asked for an Upgrade (without a body) and was read whole: the
            # rest is HTTP/1.1 again, for a parser of its own.
            self._parser = httptools.HttpRequestParser(self)
            rest = memoryview(data)[int(exc.args[0]) :]
            if len(rest) and not self._last:
                inbox = self._inbox
                self._inbox = memoryview(bytes(rest) + (b"" if inbox is None else bytes(inbox)))
        elif not self._last:  # else: bytes after a request that ended the connection
            what = type(exc).__name__  # its text may quote the request
            self._refuse(400, "malformed_http", f"the request is not valid HTTP/1.1 ({what})")

    def _refuse(
        self, status: int, code: str, message: str, response: Response | None = None
    ) -> None:
        """Parse nothing more: answer what was queued before, then this, then close."""
        self._last = True
        self._inbox = None
        self._state = _IDLE
        if response is None:
            response = self._handler.refuse(status, code, message)
        self._refusal = response  # sent by _work once the queue is answered

    # ---------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._state = _HEAD
        self._begun = time.perf_counter()
        self._url = b""
        self._headers = {}
        self._header_count = 0
        self._head_bytes = 0
        self._body = []
        self._body_size = 0
        self._request = None
        self._early = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE_BYTES:
            raise _Refused(
                414, "uri_too_long", f"the request target is over {MAX_LINE_BYTES} bytes"
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        size = len(name) + len(value)
        self._head_bytes += size + 4
        if (
            size > MAX_LINE_BYTES
            or self._head_bytes > self._max_head_bytes
            or self._header_count > MAX_HEADERS
        ):
            self._head_too_large(size)
        if self._request is not None:
            return  # a chunked body's trailer: counted, not kept (RFC 9110 §6.5.1)
        key = name.decode("latin-1").lower()
        # As aiohttp read them: a token or type in UTF-8 compares as the text it is;
        # without the whitespace llhttp leaves after a value (RFC 9110 §5.5).
        text = value.rstrip(b" \t").decode("utf-8", "surrogateescape")
        known = self._headers.get(key)
        if known is None:
            self._headers[key] = text
        elif key == "host":  # RFC 9112 §3.2: exactly one
            raise _malformed("more than one Host")
        else:
            self._headers[key] = f"{known}, {text}"

    def _head_too_large(self, size: int) -> NoReturn:
        if self._header_count > MAX_HEADERS:
            raise _too_large(f"head has over {MAX_HEADERS} header lines")
        if size > MAX_LINE_BYTES:
            raise _too_large(f"header is over {MAX_LINE_BYTES} bytes")
        raise _too_large(f"header lines are over {self._max_head_bytes} bytes")

    def on_headers_complete(self) -> None:
        parser = self._parser
        version = parser.get_http_version()
        headers = self._headers
        if version != "1.1":
            if version != "1.0":
                raise _Refused(
                    505, "http_version_not_supported", "the service speaks HTTP/1.1 (and 1.0)"
                )
        elif "host" not in headers:  # RFC 9112 §3.2: exactly one in HTTP/1.1
            raise _malformed("no Host")
        method = parser.get_method().decode("ascii")
        if ("upgrade" in headers or method == "CONNECT") and parser.should_upgrade():
            # llhttp would skip the body and hand the rest of the stream over: a CONNECT
            # tunnel or an upgraded protocol, neither of which the service speaks.
            if method == "CONNECT":
                raise _Refused(501, "not_implemented", "CONNECT is not supported")
            if "transfer-encoding" in headers or headers.get("content-length", "0") != "0":
                raise _malformed("Upgrade with a body")
        self._state = _BODY
        request = Request(method, self._url, headers, self._remote, self._begun)
        request.version = version
        request.keep_alive = parser.should_keep_alive()
        self._request = request
        self._early = self._handler.head(request)
        expects = "expect" in headers and headers["expect"].lower() == "100-continue"
        if expects and self._early is not None:
            # The client waits for a 100 before it sends the body: answer now (after the
            # requests before it) and close, as the body will not come.
            raise _Refused(self._early.status, "", "", self._early)
        if expects and not self._queue and self._transport is not None:
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
        self._state = _IDLE
        if not request.keep_alive:  # nothing after it is read (RFC 9112 §9.6)
            self._last = True
            self._inbox = None

    # ------------------------------------------------------------------ answers

    async def _await(self, request: Request, answer: Awaitable[Response]) -> None:
        try:
            response = await answer
        except Exception:  # as in _work: a 500, and the requests behind it go on
            log.exception("internal error answering %s", request.method)
            response = self._handler.refuse(
                500, "internal_error", "internal error; nothing was acknowledged"
            )
        finally:
            self._running = None
        if self._queue and self._queue[0][0] is request:
            self._queue.popleft()
        self._restart_head_clock()
        self._send(response, request)
        self._work()

    def _send(
        self, response: Response, request: Request | None = None, *, keep_alive: bool = True
    ) -> None:
        transport = self._transport
        if transport is None or self._sent_last:
            return
        server = self._server
        if request is not None:
            keep_alive = keep_alive and request.keep_alive and not server.draining
        connection = b""
        if not keep_alive:
            connection = b"Connection: close\r\n"
            # Nothing after this answer is read, answered or written.
            self._last = self._sent_last = True
            self._queue.clear()
            self._inbox = None
            self._refusal = None
        elif request is not None and request.version == "1.0":
            connection = b"Connection: keep-alive\r\n"
        head = request is not None and request.method == "HEAD"
        clock = server.clock
        transport.write(response.wire(clock.value, connection, head))
        self.last_active = clock.now
        if server.access_log and request is not None and access_log.isEnabledFor(logging.INFO):
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
            self._linger(transport)

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close after the last answer without losing it: shut the sending side (the
        client reads the answer, then the end), read and drop what the client still
        sends (the rest of a refused body) until it closes or :data:`_LINGER_S` passed.
        Closed at once, the socket would answer those bytes with a reset, which can
        reach the client before it read the answer."""
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        if self._eof or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._server.loop.call_later(_LINGER_S, transport.close)

    # ------------------------------------------------------------------- server

    @property
    def busy(self) -> bool:
        """Answers are owed to the client (requests parsed, not answered yet)."""
        return self._owed() and not self._sent_last

    def sweep(self, now: float) -> None:
        """The timeouts, checked about once a second by the server: a client's clocks
        run only while it owes the server bytes (none while answers are owed to it)."""
        if self._sent_last:
            return
        limits = self._limits
        if self._write_paused:
            if now - self._write_paused_at > limits.send_timeout_s:
                self.close()  # it reads nothing: it would not read a 408 either, nor a FIN
            return
        if self._owed() or self._inbox is not None:
            return
        state = self._state
        if state == _IDLE:
            # last_active is the clock's second (at most a second early): never closed
            # before the timeout, at most a second after it.
            if now - self.last_active > limits.keepalive_timeout_s + 1.0:
                self.close()
        elif state == _HEAD:
            if now - self._begun > limits.head_timeout_s:
                self._timed_out(f"the request's head took over {limits.head_timeout_s:g} s")
        elif (self._request, self._body_size) != self._watched:
            self._watched, self._watched_at = (self._request, self._body_size), now
        elif now - self._watched_at > limits.body_timeout_s:
            self._timed_out(f"the request's body made no progress for {limits.body_timeout_s:g} s")

    def _timed_out(self, message: str) -> None:
        self._refuse(408, "request_timeout", message)
        self._work()

    def close(self) -> None:
        """Close now (on an idle connection, at a timeout, or at the drain's deadline,
        where the request still running is cancelled: it acknowledges nothing). Answers
        still unread are dropped: a client that does not read would hold the socket
        open for ever."""
        self._last = self._sent_last = True
        if self._running is not None:
            self._running.cancel()
        if self._transport is not None:
            if self._transport.get_write_buffer_size():
                self._transport.abort()
            else:
                self._transport.close()


class HttpServer:
    """The listening socket and its connections; see the module's docstring."""

    def __init__(
        self,
        handler: Handler,
        *,
        keepalive_timeout_s: float = 75.0,
        limits: Limits | None = None,
        access_log: bool = False,
    ) -> None:
        self.handler = handler
        if limits is None:
            limits = Limits(keepalive_timeout_s=keepalive_timeout_s)
        self.limits = limits
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
        self._sweeper = asyncio.create_task(self._sweep(), name="dedup-http-sweep")
        self.clock.start(loop)
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def _sweep(self) -> None:
        """Apply the timeouts, about once a second (more often for a shorter one)."""
        limits = self.limits
        shortest = min(
            limits.keepalive_timeout_s,
            limits.head_timeout_s,
            limits.body_timeout_s,
            limits.send_timeout_s,
        )
        while True:
            await asyncio.sleep(min(1.0, shortest / 2))
            now = time.perf_counter()
            for connection in list(self.connections):
                connection.sweep(now)

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting, close the connections owed no answer, wait (up to
        ``timeout_s``) for the requests in flight to be answered, then close every
        connection."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + timeout_s
        while True:
            for connection in list(self.connections):
                if not connection.busy:
                    connection.close()
            if not self.connections or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.close()  # at the deadline: what still runs acknowledges nothing
        self.clock.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
