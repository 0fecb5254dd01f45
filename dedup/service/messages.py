"""The HTTP server's requests and answers (:mod:`dedup.service.http`), what it asks of
its handler, and what one client may hold of it."""

from __future__ import annotations

import http
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Handler", "Limits", "Request", "Response"]


class Request:
    """One request: ``method`` (upper case), ``path`` (as sent, without the query; an
    absolute-form target's path), ``query`` (after ``?``, raw), ``headers`` (names in
    lower case; repeated fields joined with ", "), ``body`` (bytes), ``version``
    ("1.1"), and ``remote`` (the peer's address). ``route`` is the handler's own:
    :meth:`Handler.head` may leave there what :meth:`Handler.handle` needs."""

    __slots__ = ("body", "headers", "keep_alive", "method", "path", "query", "remote", "route",
                 "started", "version")  # fmt: skip

    def __init__(
        self,
        method: str,
        target: bytes,
        headers: dict[str, str],
        remote: str,
        started: float | None = None,
    ) -> None:
        if target[:1] != b"/":
            target = _origin_form(target)
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
        self.started = time.perf_counter() if started is None else started


def _origin_form(target: bytes) -> bytes:
    """An absolute-form target's path and query (RFC 9112 §3.2.2: a server must accept
    it, and its authority overrides Host); any other target as it is."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    for at, byte in enumerate(rest):
        if byte == 0x2F:  # "/"
            return rest[at:]
        if byte == 0x3F:  # "?"
            return b"/" + rest[at:]
    return b"/"


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
        """The answer to a request the server refuses itself (a 400 ``malformed_http``,
        a 408 ``request_timeout``, a 413 ``body_too_large``...); counted by the handler
        like any answer."""

    def connection_refused(self) -> None:
        """Called when a connection is closed at accept: ``max_connections`` are open."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may hold of the server, and for how long: the service's settings
    of the same names (:class:`dedup.service.settings.ServiceSettings` documents each;
    the module's docstring says what a client sees)."""

    keepalive_timeout_s: float = 75.0
    head_timeout_s: float = 20.0
    body_timeout_s: float = 20.0
    send_timeout_s: float = 30.0
    max_head_bytes: int = 65536
    max_connections: int = 4096


_STATUS_LINES: dict[int, bytes] = {
    status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()
    for status in http.HTTPStatus
}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Unknown\r\n".encode()
