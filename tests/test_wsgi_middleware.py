"""dedup.wsgi's DedupMiddleware at the edges of a WSGI response's life: a request body the
client cut short, and a response the server closes before reading it. A real threading
wsgiref server, a real SyncGateway on the session's redis-server and PostgreSQL."""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.util import setup_testing_defaults

import pytest

from dedup import SyncGateway
from dedup.wsgi import DedupMiddleware

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

DEADLINE_S = 30.0


class _Body:
    """An app's response body that counts its close() calls (PEP 3333 says it is closed)."""

    def __init__(self, chunks: list[bytes], app: Orders) -> None:
        self._chunks = chunks
        self._app = app

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._chunks)

    def close(self) -> None:
        with self._app.lock:
            self._app.closed += 1


@dataclass
class Orders:
    """The app: 201 echoing a JSON body, 400 ``bad_json`` for anything else."""

    runs: int = 0
    closed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> _Body:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        with self.lock:
            self.runs += 1
        json_type = [("Content-Type", "application/json")]
        try:
            json.loads(body)
        except ValueError:
            start_response("400 Bad Request", json_type)
            return _Body([b'{"error": "bad_json"}'], self)
        start_response("201 Created", json_type)
        return _Body([b'{"order": ', body, b"}"], self)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class Served:
    app: Orders
    middleware: DedupMiddleware
    port: int


@pytest.fixture
def gateway(redis_url: str, pg_url: str) -> Iterator[SyncGateway]:
    with SyncGateway(redis_url, pg_url, lease_ms=600) as gw:
        yield gw


@pytest.fixture
def served(gateway: SyncGateway) -> Iterator[Served]:
    app = Orders()
    middleware = DedupMiddleware(app, gateway=gateway)
    server = make_server(
        "127.0.0.1", 0, middleware, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, name="wsgi-server", daemon=True)
    thread.start()
    try:
        yield Served(app, middleware, server.server_port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(DEADLINE_S)


def _post(port: int, key: str, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
    try:
        conn.request(
            "POST",
            "/orders",
            body,
            {"Idempotency-Key": key, "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read()), dict(response.getheaders())
    finally:
        conn.close()


def _post_cut_short(port: int, key: str, body: bytes, sent: int) -> tuple[int, dict[str, Any]]:
    """POST announcing ``len(body)`` bytes, send ``sent`` of them and stop sending (a
    client that went away mid-body); the answer the server still writes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        head = (
            "POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Idempotency-Key: {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        sock.sendall(head.encode() + body[:sent])
        sock.shutdown(socket.SHUT_WR)  # the server's read of the body ends here
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status_line, _, rest = raw.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload)


def test_a_body_cut_short_is_refused_without_claiming_the_key(served: Served) -> None:
    body = b'{"item": "book", "quantity": 2}'
    status, problem = _post_cut_short(served.port, "cut-1", body, sent=10)
    assert (status, problem["error"]) == (400, "incomplete_body")
    assert "10 of the 31 bytes" in problem["detail"]
    assert served.app.runs == 0  # the app never saw the truncated request
    # The client's retry with the whole body runs, as a first request would.
    status, answer, _ = _post(served.port, "cut-1", body)
    assert (status, answer) == (201, {"order": {"item": "book", "quantity": 2}})
    assert served.app.runs == 1
    status, answer, headers = _post(served.port, "cut-1", body)
    assert (status, headers.get("Idempotent-Replayed")) == (201, "true")
    assert served.app.runs == 1


def _environ(key: str, body: bytes) -> dict[str, Any]:
    environ: dict[str, Any] = {}
    setup_testing_defaults(environ)
    environ.update(
        REQUEST_METHOD="POST",
        PATH_INFO="/orders",
        CONTENT_LENGTH=str(len(body)),
        HTTP_IDEMPOTENCY_KEY=key,
    )
    environ["wsgi.input"] = io.BytesIO(body)
    return environ


def _call(middleware: DedupMiddleware, key: str, body: bytes) -> tuple[list[str], Any]:
    """Call the middleware as a server (or an outer middleware) does: the status lines
    it started, and the response iterable it returned (not read)."""
    statuses: list[str] = []

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        statuses.append(status)
        return lambda data: None

    return statuses, middleware(_environ(key, body), start_response)


def test_a_response_closed_unread_releases_its_key(served: Served) -> None:
    body = b'{"item": "pen"}'
    statuses, response = _call(served.middleware, "closed-1", body)
    assert statuses == ["201 Created"] and served.app.runs == 1
    response.close()  # before the first chunk was asked for
    assert served.app.closed == 1  # the app's own response is closed too
    # Not stored (the answer was never sent) and not held: the next request runs.
    statuses, response = _call(served.middleware, "closed-1", body)
    assert statuses == ["201 Created"] and served.app.runs == 2
    assert b"".join(response) == b'{"order": {"item": "pen"}}'
    response.close()
    assert served.app.closed == 2
    statuses, response = _call(served.middleware, "closed-1", body)
    assert statuses == ["201 Created"] and served.app.runs == 2  # stored: replayed
    assert b"".join(response) == b'{"order": {"item": "pen"}}'


def test_a_response_closed_midway_releases_its_key_once(served: Served) -> None:
    body = b'{"item": "ink"}'
    statuses, response = _call(served.middleware, "closed-2", body)
    chunks = iter(response)
    assert next(chunks) == b'{"order": '  # one chunk out, the key not settled yet
    response.close()
    response.close()  # twice is fine
    assert served.app.closed == 1
    assert list(chunks) == []  # nothing more after close()
    statuses, response = _call(served.middleware, "closed-2", body)
    assert statuses == ["201 Created"] and served.app.runs == 2
    response.close()
