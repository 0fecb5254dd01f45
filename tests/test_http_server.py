"""The service's HTTP/1.1 server (:mod:`dedup.service.http`) on real loopback sockets.

The client side is raw bytes over ``asyncio.open_connection``, so that what is checked
is what goes over the wire: keep-alive, pipelining in order, HTTP/1.0, ``Expect:
100-continue``, HEAD, the refusals, body limits, the idle timeout, the drain and a
client that goes away mid-request. A small handler of the test's own stands in for the
service there; the last test mounts the real service (:func:`dedup.service.create_app`)
in aiohttp, over a real Redis and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import secrets
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from dedup import Gateway
from dedup.service import create_app
from dedup.service.http import (
    MAX_HEADERS,
    MAX_LINE_BYTES,
    HttpServer,
    Limits,
    Request,
    Response,
)
from dedup.service.settings import ServiceSettings

DEADLINE_S = 20.0
"""The bound on every wait for something that must happen."""
SILENCE_S = 0.2
"""How long a test listens to show that nothing arrives (it cannot prove a negative
by waiting on an event; a short bounded wait is the evidence)."""
LIMIT = 64
"""The test handler's ``max_body_bytes``."""
BIG = b"b" * 16384
"""The body of the test handler's answers to ``/big...``."""
MARKER = b"MARKER-" + secrets.token_hex(6).encode()
"""Put in refused requests: it must appear in no answer and no log line."""


# ------------------------------------------------------------------- the test's handler


@dataclass
class Recorder:
    """A :class:`~dedup.service.http.Handler` recording what the server asked of it.

    Paths: ``/early...`` is answered at its head (404); ``/slow/NAME`` by a coroutine
    that waits for ``gates[NAME]``; ``/fail`` by a coroutine that raises; anything else
    at once with ``"METHOD PATH "`` followed by the request's body.
    """

    max_body_bytes: int = LIMIT
    heads: list[str] = field(default_factory=list)
    handled: list[Request] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    connections_refused: int = 0
    gates: defaultdict[str, asyncio.Event] = field(
        default_factory=lambda: defaultdict(asyncio.Event)
    )
    started: defaultdict[str, asyncio.Event] = field(
        default_factory=lambda: defaultdict(asyncio.Event)
    )
    finished: defaultdict[str, asyncio.Event] = field(
        default_factory=lambda: defaultdict(asyncio.Event)
    )
    cancelled: defaultdict[str, asyncio.Event] = field(
        default_factory=lambda: defaultdict(asyncio.Event)
    )

    def head(self, request: Request) -> Response | None:
        self.heads.append(request.path)
        if request.path.startswith("/early"):
            return Response(404, b'{"early":true}')
        return None

    def handle(self, request: Request) -> Response | Awaitable[Response]:
        self.handled.append(request)
        if request.path.startswith("/slow/"):
            return self._slow(request.path.removeprefix("/slow/"))
        if request.path.startswith("/big"):
            return Response(200, BIG, "text/plain")
        if request.path == "/fail":
            return self._fail()
        return Response(
            200, f"{request.method} {request.path} ".encode() + request.body, "text/plain"
        )

    def refuse(self, status: int, code: str, message: str) -> Response:
        self.refused.append((status, code))
        return Response(status, json.dumps({"error": {"code": code, "message": message}}).encode())

    def connection_refused(self) -> None:
        self.connections_refused += 1

    async def _slow(self, name: str) -> Response:
        self.started[name].set()
        try:
            await self.gates[name].wait()
        except asyncio.CancelledError:
            self.cancelled[name].set()
            raise
        self.finished[name].set()
        return Response(200, f"slow {name}".encode(), "text/plain")

    async def _fail(self) -> Response:
        await asyncio.sleep(0)
        raise RuntimeError("the handler's coroutine failed")

    def paths(self) -> list[str]:
        return [request.path for request in self.handled]


@contextlib.asynccontextmanager
async def serving(
    handler: Recorder,
    *,
    keepalive_timeout_s: float = 30.0,
    access_log: bool = False,
    **limits: Any,
) -> AsyncIterator[tuple[HttpServer, int]]:
    """An :class:`HttpServer` on 127.0.0.1 (a free port), drained at the end; ``limits``
    are :class:`~dedup.service.http.Limits` fields."""
    server = HttpServer(
        handler,
        limits=Limits(keepalive_timeout_s=keepalive_timeout_s, **limits),
        access_log=access_log,
    )
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await asyncio.wait_for(server.drain(5.0), DEADLINE_S)


# ------------------------------------------------------------------------- the client


@dataclass
class Reply:
    """One answer as read off the wire (header names in lower case)."""

    status: int
    fields: list[tuple[str, str]]
    body: bytes
    raw: bytes

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.fields)

    def count(self, name: str) -> int:
        return sum(1 for key, _ in self.fields if key == name)

    def error_code(self) -> str:
        code: str = json.loads(self.body)["error"]["code"]
        return code


@dataclass
class Client:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), DEADLINE_S)

    async def reply(self, *, head_only: bool = False) -> Reply:
        """The next answer (``head_only``: an answer to HEAD, whose body is not sent)."""

        async def read() -> Reply:
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head[:-4].decode("latin-1").split("\r\n")
            version, status, _ = lines[0].split(" ", 2)
            assert version == "HTTP/1.1", lines[0]
            fields = []
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                assert sep, line
                fields.append((name.strip().lower(), value.strip()))
            body = b""
            if not head_only and not 100 <= int(status) < 200:
                length = dict(fields).get("content-length")
                assert length is not None, lines
                body = await self.reader.readexactly(int(length))
            return Reply(int(status), fields, body, head + body)

        return await asyncio.wait_for(read(), DEADLINE_S)

    async def eof(self) -> bytes:
        """Everything until the server closes the connection."""
        return await asyncio.wait_for(self.reader.read(), DEADLINE_S)

    async def silent(self) -> None:
        """Nothing arrives for :data:`SILENCE_S` (and the connection stays open)."""
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(self.reader.read(1), SILENCE_S)


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[Client]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), DEADLINE_S)
    try:
        yield Client(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(writer.wait_closed(), DEADLINE_S)


def get(path: str, *extra: str, method: str = "GET", version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: test", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def post(path: str, body: bytes, *extra: str) -> bytes:
    return get(path, f"Content-Length: {len(body)}", *extra, method="POST") + body


def chunked(path: str, *chunks: bytes) -> bytes:
    head = get(path, "Transfer-Encoding: chunked", method="POST")
    return head + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (*chunks, b""))


@pytest.fixture(autouse=True)
def no_loop_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """No test may leave an error of the event loop's (a task's exception never
    retrieved, a callback that failed) or of the server's own in the log."""
    caplog.set_level(logging.WARNING)
    yield
    errors = [r for r in caplog.records if r.name in ("asyncio", "dedup.service")]
    errors = [r for r in errors if r.levelno >= logging.ERROR and "_fail" not in r.getMessage()]
    assert not errors, [r.getMessage() for r in errors]


# -------------------------------------------------------------------- 1. keep-alive


async def test_keep_alive_answers_every_request_on_one_connection() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        for n in range(5):
            await client.send(get(f"/ka/{n}"))
            reply = await client.reply()
            assert reply.status == 200
            assert reply.body == f"GET /ka/{n} ".encode()
            assert reply.headers["content-length"] == str(len(reply.body))
            assert reply.headers["content-type"] == "text/plain"
            assert parsedate_to_datetime(reply.headers["date"]).tzinfo is not None
            assert reply.count("connection") == 0  # HTTP/1.1: keep-alive is the default
        assert handler.paths() == [f"/ka/{n}" for n in range(5)]


async def test_header_names_are_lower_case_and_values_read_as_utf_8() -> None:
    """As aiohttp read them: a bearer token in UTF-8 compares as the text it is; bytes
    that are not UTF-8 survive as surrogates (and match no token)."""
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        token = "Bearer t\N{LATIN SMALL LETTER O WITH DIAERESIS}ken"
        await client.send(
            get("/h", "X-Token: " + token)
            .replace(b"X-Token: ", b"X-TOKEN: ")
            .replace(token.encode("latin-1"), token.encode())
            + get("/h", "X-Raw: a").replace(b"X-Raw: a", b"X-Raw: \xff")
        )
        assert (await client.reply()).status == 200
        assert (await client.reply()).status == 200
    first, second = handler.handled
    assert first.headers["x-token"] == token
    assert second.headers["x-raw"] == "\udcff"


async def test_connection_close_from_the_client_is_honoured() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(get("/bye", "Connection: close"))
        reply = await client.reply()
        assert (reply.status, reply.headers["connection"]) == (200, "close")
        assert await client.eof() == b""


# ------------------------------------------------------------------- 2. pipelining


async def test_pipelined_requests_are_answered_in_order() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        paths = ["/sync/1", "/slow/a", "/sync/2", "/slow/b", "/sync/3"]
        await client.send(b"".join(get(path) for path in paths))
        first = await client.reply()
        assert first.body == b"GET /sync/1 "
        await asyncio.wait_for(handler.started["a"].wait(), DEADLINE_S)
        await client.silent()  # /slow/a holds up everything behind it

        # Released in reverse order of arrival: b first, then a.
        handler.gates["b"].set()
        await client.silent()
        assert not handler.started["b"].is_set()  # not run ahead of a
        handler.gates["a"].set()

        bodies = [(await client.reply()).body for _ in paths[1:]]
        assert bodies == [b"slow a", b"GET /sync/2 ", b"slow b", b"GET /sync/3 "]
        assert handler.paths() == paths


async def test_many_pipelined_requests_behind_a_slow_one_are_all_answered_in_order() -> None:
    # More than the server parses ahead (it pauses reading, then resumes).
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        count = 200
        await client.send(get("/slow/first") + b"".join(get(f"/n/{n}") for n in range(count)))
        await asyncio.wait_for(handler.started["first"].wait(), DEADLINE_S)
        await client.silent()
        handler.gates["first"].set()
        assert (await client.reply()).body == b"slow first"
        for n in range(count):
            assert (await client.reply()).body == f"GET /n/{n} ".encode()
        assert handler.paths() == ["/slow/first", *(f"/n/{n}" for n in range(count))]


# -------------------------------------------------------------------- 3. HTTP/1.0


async def test_http_1_0_without_keep_alive_is_closed_after_its_answer() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(get("/old", version="1.0"))
        reply = await client.reply()
        assert (reply.status, reply.body) == (200, b"GET /old ")
        assert reply.headers["connection"] == "close"
        assert await client.eof() == b""


async def test_http_1_0_with_keep_alive_stays_open() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        for n in range(3):
            await client.send(get(f"/old/{n}", "Connection: keep-alive", version="1.0"))
            reply = await client.reply()
            assert (reply.status, reply.body) == (200, f"GET /old/{n} ".encode())
            assert reply.headers["connection"] == "keep-alive"
            assert reply.count("connection") == 1
        await client.silent()  # still open


# -------------------------------------------------------------- 4. 100-continue


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        body = b"hello"
        head = get("/up", f"Content-Length: {len(body)}", "Expect: 100-continue", method="POST")
        await client.send(head)
        interim = await client.reply()
        assert interim.status == 100
        assert interim.raw == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert handler.handled == []
        await client.send(body)
        reply = await client.reply()
        assert (reply.status, reply.body) == (200, b"POST /up hello")
        # The connection goes on.
        await client.send(get("/next"))
        assert (await client.reply()).body == b"GET /next "


async def test_expect_100_continue_answered_at_its_head_gets_no_100() -> None:
    # The client waits for a 100 before it sends its body: the answer decided at the
    # head must come without the body, and the connection then closes (the body, which
    # the client will not send, is not read).
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        head = get("/early", "Content-Length: 5", "Expect: 100-continue", method="POST")
        await client.send(head)
        reply = await client.reply()
        assert (reply.status, reply.body) == (404, b'{"early":true}')
        assert reply.headers["connection"] == "close"
        rest = await client.eof()
        assert b"100 Continue" not in reply.raw + rest
        assert rest == b""
        assert handler.handled == []


async def test_expect_100_continue_answered_at_its_head_waits_for_the_requests_before_it() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        head = get("/early", "Content-Length: 5", "Expect: 100-continue", method="POST")
        await client.send(get("/slow/before") + head)
        await asyncio.wait_for(handler.started["before"].wait(), DEADLINE_S)
        await client.silent()
        handler.gates["before"].set()
        assert (await client.reply()).body == b"slow before"
        reply = await client.reply()
        assert (reply.status, reply.headers["connection"]) == (404, "close")
        assert await client.eof() == b""


# ----------------------------------------------------------------------- 5. HEAD


async def test_head_gets_the_length_of_the_body_and_no_body() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(get("/thing", method="HEAD"))
        reply = await client.reply(head_only=True)
        assert reply.status == 200
        assert reply.headers["content-length"] == str(len(b"HEAD /thing "))
        # No body followed: the next bytes are the next answer's status line.
        await client.send(get("/after"))
        after = await client.reply()
        assert (after.status, after.body) == (200, b"GET /after ")


# ------------------------------------------------------------------- 6. refusals

_REFUSED = {
    "garbage request line": (b"THIS IS NOT " + MARKER + b"\r\n\r\n", 400, "malformed_http"),
    "request target too long": (
        get("/" + MARKER.decode() + "a" * MAX_LINE_BYTES),
        414,
        "uri_too_long",
    ),
    "header too long": (
        get("/x", f"X-Big: {MARKER.decode()}{'v' * MAX_LINE_BYTES}"),
        431,
        "headers_too_large",
    ),
    "too many headers": (
        get("/x", *(f"X-H{n}: {MARKER.decode()}" for n in range(MAX_HEADERS + 1))),
        431,
        "headers_too_large",
    ),
    "head over max_head_bytes": (
        get("/x", *(f"X-H{n}: {MARKER.decode()}{'h' * 8000}" for n in range(9))),
        431,
        "headers_too_large",
    ),
    "bad chunk size": (
        get("/x", "Transfer-Encoding: chunked", method="POST")
        + b"zz"
        + MARKER
        + b"\r\nhello\r\n0\r\n\r\n",
        400,
        "malformed_http",
    ),
    "HTTP/1.1 without Host": (
        f"GET /x{MARKER.decode()} HTTP/1.1\r\nX-A: b\r\n\r\n".encode(),
        400,
        "malformed_http",
    ),
    "two Hosts": (get("/x", f"Host: {MARKER.decode()}"), 400, "malformed_http"),
    "two Hosts in HTTP/1.0": (
        get("/x", f"Host: {MARKER.decode()}", version="1.0"),
        400,
        "malformed_http",
    ),
    "HTTP/2.0 request line": (
        get(f"/{MARKER.decode()}", version="2.0"),
        505,
        "http_version_not_supported",
    ),
    "CONNECT": (
        f"CONNECT {MARKER.decode()}:443 HTTP/1.1\r\nHost: {MARKER.decode()}:443\r\n\r\n".encode(),
        501,
        "not_implemented",
    ),
    "Upgrade with a body": (
        post(
            "/x",
            b'{"kind":"k","value":"' + MARKER + b'"}',
            "Upgrade: websocket",
            "Connection: Upgrade",
        )
        + get("/behind"),
        400,
        "malformed_http",
    ),
}


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"), list(_REFUSED.values()), ids=list(_REFUSED)
)
async def test_refused_requests_get_one_answer_and_a_close(
    request_bytes: bytes, status: int, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Exactly one answer (the handler's JSON error), then the end: nothing after the
    refused request is read or answered, and nothing of it is quoted or logged."""
    caplog.set_level(logging.DEBUG)
    handler = Recorder()
    async with serving(handler, access_log=True) as (_, port), connect(port) as client:
        await client.send(request_bytes)
        reply = await client.reply()
        assert reply.status == status
        assert reply.error_code() == code
        assert reply.headers["connection"] == "close"
        rest = await client.eof()
        assert rest == b""
        assert MARKER not in reply.raw
        assert handler.refused == [(status, code)]
        assert handler.handled == []
    assert all(MARKER.decode() not in r.getMessage() for r in caplog.records)


async def test_a_refusal_comes_after_the_answers_of_the_requests_before_it() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(get("/one") + get("/slow/two") + b"NOT HTTP\r\n\r\n")
        assert (await client.reply()).body == b"GET /one "
        await asyncio.wait_for(handler.started["two"].wait(), DEADLINE_S)
        handler.gates["two"].set()
        assert (await client.reply()).body == b"slow two"
        refusal = await client.reply()
        assert (refusal.status, refusal.headers["connection"]) == (400, "close")
        assert await client.eof() == b""


async def test_a_request_line_too_long_in_pieces_is_refused() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(b"GET /")
        for _ in range(4):
            await client.send(b"a" * (MAX_LINE_BYTES // 3))
        reply = await client.reply()
        assert (reply.status, reply.error_code()) == (414, "uri_too_long")
        assert await client.eof() == b""


# ---------------------------------------------------------------------- 7. bodies


async def test_body_over_the_limit_after_an_early_answer_gets_that_answer_and_a_close() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(post("/early", b"x" * (LIMIT + 1)))
        reply = await client.reply()
        assert (reply.status, reply.body) == (404, b'{"early":true}')
        assert reply.headers["connection"] == "close"
        assert await client.eof() == b""
        assert handler.refused == []  # the early answer, not a 413
        assert handler.handled == []


async def test_body_under_the_limit_after_an_early_answer_is_skipped_and_kept_alive() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(post("/early", b"x" * LIMIT))
        reply = await client.reply()
        assert (reply.status, reply.count("connection")) == (404, 0)
        await client.send(get("/next"))
        assert (await client.reply()).body == b"GET /next "
        assert handler.paths() == ["/next"]


async def test_body_over_the_limit_without_an_early_answer_gets_413_and_a_close() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(post("/echo", MARKER + b"x" * LIMIT))
        reply = await client.reply()
        assert (reply.status, reply.error_code()) == (413, "body_too_large")
        assert reply.headers["connection"] == "close"
        assert MARKER not in reply.raw
        assert await client.eof() == b""
        assert handler.refused == [(413, "body_too_large")]
        assert handler.handled == []


async def test_chunked_body_over_the_limit_gets_413_and_a_close() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(chunked("/echo", b"x" * LIMIT, b"y"))
        reply = await client.reply()
        assert (reply.status, reply.error_code()) == (413, "body_too_large")
        assert reply.headers["connection"] == "close"
        assert await client.eof() == b""
        assert handler.handled == []


async def test_a_client_still_sending_a_refused_body_reads_its_413() -> None:
    """The rest of a refused body, sent after the answer, is read and dropped: closed at
    once, the socket would answer it with a reset, which discards the 413 the client had
    not read yet (a client sending a large chunked body saw a broken pipe instead)."""
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        head = get("/echo", "Transfer-Encoding: chunked", method="POST")
        await client.send(head + b"%x\r\n%s\r\n" % (LIMIT + 1, b"x" * (LIMIT + 1)))
        await asyncio.sleep(0.3)  # the server has refused it by now (its 413 is on its way)
        for _ in range(16):  # the client goes on sending, as it does not read yet
            await client.send(b"%x\r\n%s\r\n" % (4096, b"y" * 4096))
        reply = await client.reply()
        assert (reply.status, reply.error_code()) == (413, "body_too_large")
        assert await client.eof() == b""
        assert handler.handled == []


async def test_chunked_body_under_the_limit_arrives_whole() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        whole = chunked("/echo", b"hello", b" ", b"chunked ", b"world")
        head_end = whole.index(b"\r\n\r\n") + 4
        # Sent in pieces: the head, then a few bytes at a time.
        await client.send(whole[:head_end])
        for at in range(head_end, len(whole), 7):
            await client.send(whole[at : at + 7])
        reply = await client.reply()
        assert (reply.status, reply.body) == (200, b"POST /echo hello chunked world")
        assert [r.body for r in handler.handled] == [b"hello chunked world"]
        await client.send(get("/next"))
        assert (await client.reply()).body == b"GET /next "


async def test_body_of_exactly_the_limit_is_accepted() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(post("/echo", b"z" * LIMIT))
        reply = await client.reply()
        assert (reply.status, reply.body) == (200, b"POST /echo " + b"z" * LIMIT)


# ------------------------------------------------------------------ 8. idle timeout


async def test_idle_connections_are_closed_after_the_keepalive_timeout() -> None:
    handler = Recorder()
    loop = asyncio.get_running_loop()
    async with serving(handler, keepalive_timeout_s=0.5) as (server, port), connect(port) as client:
        await client.send(get("/once"))
        assert (await client.reply()).status == 200
        answered = loop.time()
        assert await client.eof() == b""
        # Not before the timeout (a little slack: the server's clock started at its write).
        assert loop.time() - answered >= 0.4
        async with connect(port) as silent:  # one that never sends a byte
            assert await silent.eof() == b""
        assert not server.connections


async def test_a_connection_in_use_is_not_closed_by_the_keepalive_timeout() -> None:
    handler = Recorder()
    async with serving(handler, keepalive_timeout_s=0.5) as (_, port), connect(port) as client:
        await client.send(get("/slow/long"))
        await asyncio.wait_for(handler.started["long"].wait(), DEADLINE_S)
        # Three sweeps of the idle timer pass while the request runs (bounded, see SILENCE_S).
        await asyncio.sleep(1.5)
        handler.gates["long"].set()
        reply = await client.reply()
        assert (reply.status, reply.body, reply.count("connection")) == (200, b"slow long", 0)


# ------------------------------------------------------------------------- 9. drain


async def test_drain_finishes_requests_in_flight_and_closes_idle_connections() -> None:
    handler = Recorder()
    async with serving(handler) as (server, port), connect(port) as busy, connect(port) as idle:
        await idle.send(get("/hello"))
        assert (await idle.reply()).status == 200
        await busy.send(get("/slow/inflight"))
        await asyncio.wait_for(handler.started["inflight"].wait(), DEADLINE_S)

        drain = asyncio.create_task(server.drain(DEADLINE_S))
        assert await idle.eof() == b""  # at once
        with pytest.raises(ConnectionRefusedError):
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), DEADLINE_S)
        assert not drain.done()  # it waits for the request in flight

        handler.gates["inflight"].set()
        reply = await busy.reply()
        assert (reply.status, reply.body) == (200, b"slow inflight")
        assert reply.headers["connection"] == "close"
        assert await busy.eof() == b""
        await asyncio.wait_for(drain, DEADLINE_S)
        assert not handler.cancelled["inflight"].is_set()
        assert not server.connections


async def test_drain_cancels_what_still_runs_at_its_deadline() -> None:
    handler = Recorder()
    async with serving(handler) as (server, port), connect(port) as client:
        await client.send(get("/slow/stuck"))
        await asyncio.wait_for(handler.started["stuck"].wait(), DEADLINE_S)
        await asyncio.wait_for(server.drain(0.5), DEADLINE_S)
        assert await client.eof() == b""  # closed, with no answer: nothing acknowledged
        await asyncio.wait_for(handler.cancelled["stuck"].wait(), DEADLINE_S)
        assert not handler.finished["stuck"].is_set()
        assert not server.connections


# ------------------------------------------------------------ 10. client goes away


async def test_a_client_that_disconnects_does_not_cancel_its_request() -> None:
    """A client's end of sending (which a close is, to the server) leaves what it sent
    whole to be answered: the request runs on, is not cancelled, and the connection
    goes once its answer had nowhere to go."""
    handler = Recorder()
    async with serving(handler) as (server, port):
        async with connect(port) as client:
            await client.send(get("/slow/orphan"))
            await asyncio.wait_for(handler.started["orphan"].wait(), DEADLINE_S)
        await asyncio.sleep(SILENCE_S)
        assert not handler.cancelled["orphan"].is_set()
        handler.gates["orphan"].set()
        await asyncio.wait_for(handler.finished["orphan"].wait(), DEADLINE_S)
        assert not handler.cancelled["orphan"].is_set()
        # The server notices (no event to wait on: poll, bounded).
        async with asyncio.timeout(DEADLINE_S):
            while server.connections:
                await asyncio.sleep(0.01)
        # The server goes on serving.
        async with connect(port) as other:
            await other.send(get("/still-here"))
            assert (await other.reply()).body == b"GET /still-here "


async def test_a_client_that_shuts_its_sending_side_gets_every_answer() -> None:
    """Requests sent whole, then the client's FIN (shutdown(SHUT_WR)): each is answered,
    in order, and then the server closes."""
    handler = Recorder()
    async with serving(handler) as (server, port), connect(port) as client:
        await client.send(get("/a") + get("/slow/b") + get("/c") + b"GET /partial HT")
        client.writer.write_eof()
        await asyncio.wait_for(handler.started["b"].wait(), DEADLINE_S)
        handler.gates["b"].set()
        rest = await client.eof()
        assert rest.count(b"HTTP/1.1 200 OK") == 3
        assert rest.index(b"GET /a ") < rest.index(b"slow b") < rest.index(b"GET /c ")
        assert handler.paths() == ["/a", "/slow/b", "/c"]
        async with asyncio.timeout(DEADLINE_S):
            while server.connections:
                await asyncio.sleep(0.01)


# ------------------------------------------- 11. what one client may hold of a worker


def _connection(server: HttpServer) -> Any:
    """The server's one connection (the tests look at what it holds)."""
    (connection,) = server.connections
    return connection


async def _send_until_blocked(client: Client, data: bytes, most: int) -> int:
    """Send ``data`` again and again, up to ``most`` bytes, until the server stops
    reading (a send that has not drained within a second); the bytes sent."""
    sent = 0
    while sent < most:
        client.writer.write(data)
        try:
            await asyncio.wait_for(client.writer.drain(), 1.0)
        except (TimeoutError, ConnectionError):  # not read, or already cut off
            return sent
        sent += len(data)
    return sent


async def test_a_client_that_never_reads_stops_being_read() -> None:
    """Write backpressure: while a client's answers are unread, the server reads none
    of its requests, so what the worker holds for it stays bounded (a write buffer
    past its high-water mark, and a slice of parsed requests), not the answers to all
    it sent."""
    handler = Recorder()
    async with serving(handler) as (server, port), connect(port) as client:
        pipelined = get("/big") * 2000  # 16 KiB answers to 48 KiB of requests
        sent = await _send_until_blocked(client, pipelined, 64 * 1024 * 1024)
        assert sent < 64 * 1024 * 1024, "the server read everything a non-reader sent"
        connection = _connection(server)
        buffered = connection._transport.get_write_buffer_size()
        assert buffered < 1024 * 1024, buffered
        assert len(connection._queue) <= 4096 // len(get("/big")) + 1
        answered = len(handler.handled)
        await asyncio.sleep(SILENCE_S)
        assert len(handler.handled) == answered  # nothing more is answered while unread
        # Once it reads, it gets every answer, in order, and more is read.
        for _ in range(answered + 10):
            reply = await client.reply()
            assert (reply.status, reply.body) == (200, BIG)
        client.writer.transport.abort()  # what it still has to send would never drain


async def test_one_pipelining_connection_does_not_hold_up_the_others() -> None:
    """Fair service: a connection with thousands of pipelined requests waiting gets a
    few answers per turn of the loop; another client's request is answered within a
    few turns, not after all of them."""
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as busy, connect(port) as other:
        count = 20_000
        reader = asyncio.create_task(_read_answers(busy, count))
        busy.writer.write(get("/pipelined") * count)  # about 600 KB at once
        await asyncio.wait_for(busy.writer.drain(), DEADLINE_S)
        async with asyncio.timeout(DEADLINE_S):
            while not handler.handled:
                await asyncio.sleep(0)
        before = len(handler.handled)
        await other.send(get("/other"))
        assert (await other.reply()).body == b"GET /other "
        between = handler.paths().index("/other") - before
        assert between < 1000, f"{between} pipelined requests were answered before it"
        assert await asyncio.wait_for(reader, DEADLINE_S) == count


async def _read_answers(client: Client, count: int) -> int:
    for _ in range(count):
        assert (await client.reply()).status == 200
    return count


async def test_a_head_not_whole_within_head_timeout_gets_408_and_a_close() -> None:
    """A head that trickles in (a byte at a time, each well within any idle timeout) is
    timed as a whole."""
    handler = Recorder()
    async with serving(handler, head_timeout_s=0.5) as (server, port), connect(port) as client:
        await client.send(b"GET /slowloris HTTP/1.1\r\nHost: x\r\nX-")
        trickle = asyncio.create_task(_trickle(client, b"a" * 100, 0.1))
        try:
            reply = await client.reply()
        finally:
            trickle.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await trickle
        assert (reply.status, reply.error_code()) == (408, "request_timeout")
        assert reply.headers["connection"] == "close"
        assert handler.handled == []
        async with asyncio.timeout(DEADLINE_S):
            while server.connections:
                await asyncio.sleep(0.01)


async def _trickle(client: Client, data: bytes, every_s: float) -> None:
    for byte in data:
        await asyncio.sleep(every_s)
        await client.send(bytes((byte,)))


async def test_a_body_that_stalls_gets_408_and_one_that_trickles_is_served() -> None:
    handler = Recorder()
    async with serving(handler, body_timeout_s=0.6) as (_, port):
        async with connect(port) as stalled:
            await stalled.send(post("/stalled", b"0123456789")[:-7])  # 3 of its 10 bytes
            reply = await stalled.reply()
            assert (reply.status, reply.error_code()) == (408, "request_timeout")
            assert await stalled.eof() == b""
        async with connect(port) as slow:
            whole = post("/trickled", b"abcdefgh")
            await slow.send(whole[:-8])
            await _trickle(slow, b"abcdefgh", 0.2)  # 1.6 s in all, progress every 0.2 s
            reply = await slow.reply()
            assert (reply.status, reply.body) == (200, b"POST /trickled abcdefgh")
        assert handler.paths() == ["/trickled"]


async def test_a_client_that_reads_nothing_for_send_timeout_is_cut_off() -> None:
    handler = Recorder()
    async with serving(handler, send_timeout_s=0.5) as (server, port), connect(port) as client:
        await _send_until_blocked(client, get("/big") * 2000, 64 * 1024 * 1024)
        async with asyncio.timeout(DEADLINE_S):
            while server.connections:
                await asyncio.sleep(0.05)


async def test_connections_over_max_connections_are_closed_at_accept() -> None:
    handler = Recorder()
    async with serving(handler, max_connections=2) as (server, port):
        async with connect(port) as one, connect(port) as two:
            for client in (one, two):
                await client.send(get("/in"))
                assert (await client.reply()).status == 200
            async with connect(port) as third:
                assert await third.eof() == b""  # closed, with nothing said
            assert handler.connections_refused == 1
            await one.send(get("/still"))  # the others are served as before
            assert (await one.reply()).body == b"GET /still "
        async with asyncio.timeout(DEADLINE_S):
            while server.connections:
                await asyncio.sleep(0.01)
        async with connect(port) as again:  # room again
            await again.send(get("/again"))
            assert (await again.reply()).body == b"GET /again "
        assert handler.connections_refused == 1


# ------------------------------------------------------------------ 12. framing


async def test_upgrade_is_ignored_and_the_request_served_as_http_1_1() -> None:
    """One answer to an Upgrade request (as HTTP/1.1; no 101), and the connection goes
    on with the requests behind it."""
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        h2c = get(
            "/h2c",
            "Connection: Upgrade, HTTP2-Settings",
            "Upgrade: h2c",
            "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA",
        )
        await client.send(h2c + get("/after"))
        first = await client.reply()
        assert (first.status, first.body, first.count("connection")) == (200, b"GET /h2c ", 0)
        assert (await client.reply()).body == b"GET /after "
        await client.silent()  # no second answer to the Upgrade
        await client.send(get("/ws", "Connection: Upgrade", "Upgrade: websocket"))
        assert (await client.reply()).body == b"GET /ws "
        await client.send(get("/last"))
        assert (await client.reply()).body == b"GET /last "
        await client.silent()
        assert handler.paths() == ["/h2c", "/after", "/ws", "/last"]


@pytest.mark.parametrize(
    "last",
    [
        get("/last", "Connection: close"),
        get("/last", version="1.0"),
        get("/slow/last", "Connection: close"),
    ],
    ids=["connection-close", "http-1.0", "slow-connection-close"],
)
async def test_nothing_after_a_last_request_is_answered(last: bytes) -> None:
    """Requests pipelined after one that ends the connection are neither answered nor
    logged (once, the server wrote after its write_eof(): a traceback)."""
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(last + get("/behind") + b"NOT HTTP\r\n\r\n")
        handler.gates["last"].set()
        reply = await client.reply()
        assert (reply.status, reply.headers["connection"]) == (200, "close")
        assert await client.eof() == b""
        assert [path.removeprefix("/slow") for path in handler.paths()] == ["/last"]
        assert handler.refused == []


async def test_drain_with_requests_pipelined_behind_a_slow_one_ends_cleanly() -> None:
    handler = Recorder()
    async with serving(handler) as (server, port), connect(port) as client:
        await client.send(get("/slow/first") + get("/second") + get("/slow/third"))
        await asyncio.wait_for(handler.started["first"].wait(), DEADLINE_S)
        drain = asyncio.create_task(server.drain(DEADLINE_S))
        await asyncio.sleep(SILENCE_S)
        handler.gates["first"].set()
        reply = await client.reply()
        assert (reply.status, reply.body, reply.headers["connection"]) == (
            200,
            b"slow first",
            "close",
        )
        assert await client.eof() == b""
        await asyncio.wait_for(drain, DEADLINE_S)
        assert handler.paths() == ["/slow/first"]
        gc.collect()  # a task's exception never retrieved is logged when it is collected
        await asyncio.sleep(0)


async def test_an_absolute_form_target_is_served_as_its_path() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(
            b"GET http://example.com:8080/abs/path?q=1 HTTP/1.1\r\nHost: other\r\n\r\n"
            + b"GET HTTPS://example.com?only=query HTTP/1.1\r\nHost: x\r\n\r\n"
            + b"GET http://example.com HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert (await client.reply()).body == b"GET /abs/path "
        assert (await client.reply()).body == b"GET / "
        assert (await client.reply()).body == b"GET / "
    assert [(r.path, r.query) for r in handler.handled] == [
        ("/abs/path", "q=1"),
        ("/", "only=query"),
        ("/", ""),
    ]


async def test_http_1_0_may_omit_host() -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(b"GET /old HTTP/1.0\r\n\r\n")
        assert (await client.reply()).body == b"GET /old "


# ------------------------------------------------------------------ other behaviours


async def test_a_handler_coroutine_that_fails_gets_500_and_the_connection_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = Recorder()
    async with serving(handler) as (_, port), connect(port) as client:
        await client.send(get("/fail") + get("/after"))
        reply = await client.reply()
        assert (reply.status, reply.error_code()) == (500, "internal_error")
        assert (await client.reply()).body == b"GET /after "
        assert handler.paths() == ["/fail", "/after"]  # the failed one was not run again
    assert any("internal error" in r.getMessage() for r in caplog.records)


async def test_the_access_log_has_one_line_per_request_without_query_or_headers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dedup.access")
    handler = Recorder()
    async with serving(handler, access_log=True) as (_, port), connect(port) as client:
        secret = MARKER.decode()
        await client.send(get(f"/logged?token={secret}", f"Authorization: Bearer {secret}"))
        assert (await client.reply()).status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "dedup.access"]
    assert len(lines) == 1
    assert '"GET /logged HTTP/1.1" 200' in lines[0]
    assert secret not in lines[0]


# ------------------------------------------------------ the aiohttp embedding, for real

TOKEN = "tok-" + secrets.token_hex(12)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
APP_MAX_BODY = 1024


async def test_create_app_serves_the_service_in_aiohttp(redis_url: str, pg_url: str) -> None:
    settings = ServiceSettings(auth_token=TOKEN, max_body_bytes=APP_MAX_BODY)
    app = create_app(Gateway(redis_url, pg_url), settings)
    runner = web.AppRunner(app)
    await asyncio.wait_for(runner.setup(), DEADLINE_S)  # opens the Gateway
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        base = f"http://127.0.0.1:{port}"
        timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
        async with aiohttp.ClientSession(base, timeout=timeout) as http:
            item = {"kind": "email", "value": "a@example.com"}
            async with http.post("/v1/save", json=item, headers=AUTH) as r:
                assert (r.status, await r.json()) == (201, {"created": True, "source": "write"})
            async with http.post("/v1/save", json=item, headers=AUTH) as r:
                assert r.status == 200
                assert (await r.json())["created"] is False

            async with http.get("/nowhere", headers=AUTH) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (404, "not_found")
            async with http.get("/v1/save", headers=AUTH) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (405, "method_not_allowed")
                assert r.headers["Allow"] == "POST"
            async with http.post("/v1/save", json={"kind": "email", "value": "b@x"}) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (401, "unauthorized")
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
            wrong = {**AUTH, "Content-Type": "text/plain"}
            async with http.post("/v1/save", data=b'{"kind":"k","value":"v"}', headers=wrong) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (
                    415,
                    "unsupported_media_type",
                )
            big = json.dumps({"kind": "email", "value": "c" * APP_MAX_BODY}).encode()
            typed = {**AUTH, "Content-Type": "application/json"}
            async with http.post("/v1/save", data=big, headers=typed) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (413, "body_too_large")

            async def stream() -> AsyncIterator[bytes]:  # no Content-Length: chunked
                for at in range(0, len(big), 256):
                    yield big[at : at + 256]

            async with http.post("/v1/save", data=stream(), headers=typed) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (413, "body_too_large")

            async with http.get("/healthz") as r:
                assert (r.status, await r.json()) == (200, {"status": "ok", "pid": os.getpid()})

        conn = await asyncpg.connect(pg_url, timeout=DEADLINE_S)
        try:
            rows = await conn.fetch("SELECT kind, value FROM dedup_items")
        finally:
            await conn.close()
        assert [(row["kind"], row["value"]) for row in rows] == [("email", "a@example.com")]
    finally:
        await asyncio.wait_for(runner.cleanup(), DEADLINE_S)  # closes the Gateway
