"""Byte-level fuzz of the service's HTTP/1.1 server (:mod:`dedup.service.http`).

Three property tests, all over real loopback sockets, every byte stream split at
hypothesis-chosen cut points into several sends (with short pauses between some):

A. **Framing oracle** (in-process :class:`~dedup.service.http.HttpServer`, an echo
   handler). 1-8 well-formed HTTP/1.1 requests, pipelined: GET/POST/PUT/HEAD/DELETE,
   one Host header, random extra header fields (tokens; values of visible ASCII and
   obs-text with optional surrounding whitespace), query strings, an absolute-form
   target now and then, bodies framed by Content-Length (leading zeros included) or
   chunked (random chunk sizes, hex case, extensions, trailers), empty bodies, HTTP/1.0
   requests with ``Connection: keep-alive``; the last one may close (``Connection:
   close``, or HTTP/1.0 without keep-alive). h11, the pure-Python RFC 9112 parser,
   reads the same bytes as a server and is the oracle. Invariants: exactly one answer
   per request, in order, each ``200`` echoing that request's method, target and body
   (a HEAD answer carries the echo's Content-Length and no body); the Connection
   header says what the request asked for; the handler saw exactly h11's requests
   (method, target, body), with the header fields of their header section (names in
   lower case, values without the surrounding whitespace, repeated fields joined with
   ", "; trailer fields are not header fields); a closing request's answer is followed
   by the end of the connection, and after the client closes its sending side the
   server closes too, with nothing more sent; nothing logged at ERROR.

A2. **Refusal oracle** (same server). The same pipelines (without whitespace after
   field values, which A covers, and without comparing header fields) with one odd
   request among them: an HTTP/1.1 request without Host or with two (RFC 9112 section
   3.2: the server MUST answer 400), a major version it does not speak (HTTP/2.0,
   HTTP/3.0, HTTP/0.9: 400 or 505), two different Content-Lengths (MUST answer 400), a
   folded header line (MUST refuse or unfold), ``Upgrade`` (the server MAY ignore it,
   or refuse), and ``CONNECT`` (not a proxy: refused). Invariants: the requests before
   it are answered as in A; the odd one gets exactly one answer, a 2xx echo only where
   the request may be served, else a 4xx (505 for a version, 501 for CONNECT) never
   seen by the handler; after an answer with ``Connection: close`` the connection ends
   with nothing more; without it, the requests after it are answered as in A.

B. **Mutation fuzz of the real service** (one ``python -m dedup serve`` process for
   the module, on its own redis-server and PostgreSQL database, ``max_body_bytes``
   1024, no token). Pipelines of valid-looking requests to its routes (``/healthz``,
   ``/readyz``, ``/openapi.json``, ``/metrics``, ``/v1/save``, ``/v1/save/batch``,
   unknown paths; GET, HEAD, POST), then mutated at the byte level (bytes inserted,
   deleted, replaced or duplicated, CRLFs dropped or doubled, Content-Length corrupted,
   ``Transfer-Encoding: chunked`` added with bad chunks, Upgrade / ``Connection:
   close`` / ``Expect: 100-continue`` / a second Host added, Host removed, HTTP/1.0,
   HTTP/2.0 and other versions, absolute-form targets, CONNECT). The client sends it,
   shuts down its sending side and reads until the server closes. Invariants:

   - every byte received parses as HTTP/1.1 answers (status line ``HTTP/1.1 NNN``,
     header fields, a body framed by exactly one Content-Length; a bodiless answer is
     accepted only where a HEAD was sent; the only interim answer is ``100
     Continue``), and none is a 5xx;
   - no more final answers than request heads sent (counted as the ``\\r\\n\\r\\n``
     head terminators in what was sent), plus one allowed: a last refusal carrying
     ``Connection: close`` where the sent bytes end in an unterminated fragment (only
     there can the server refuse something that is not a counted head); nothing
     follows an answer carrying ``Connection: close``;
   - the server closes the connection within :data:`CLOSE_DEADLINE_S` of the client's
     end of sending, complete request or not: a client that shut its sending side can
     send nothing more, so a server still waiting for the rest of a request holds the
     connection for nothing (today's server closes at once on the client's EOF; it is
     not required to answer a request whose answer was still running);
   - the service's log (stdout and stderr) gains no ``Traceback`` and no ``ERROR`` or
     ``CRITICAL`` line, and a fresh connection's ``GET /healthz`` answers 200 after
     every example (the worker keeps serving).

Bounded for CI: a fixed seed, no example database, ``deadline=None``, and
FUZZ_BYTES_EXAMPLES (A and B), FUZZ_BYTES_SEED to widen a hunt by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import h11
import pytest
from hypothesis import HealthCheck, event, given, note, seed, settings
from hypothesis import strategies as st

from dedup.service.http import Request, Response
from tests.servers import PostgresCluster
from tests.test_http_server import DEADLINE_S, Recorder, serving
from tests.test_service import ServiceProcess, service_on_own_servers

EXAMPLES = int(os.environ.get("FUZZ_BYTES_EXAMPLES", "0")) or None
"""FUZZ_BYTES_EXAMPLES overrides every test's number of examples."""
SEED = int(os.environ.get("FUZZ_BYTES_SEED", "20240611"))
ECHO_MAX_BODY = 4096
"""The echo handler's ``max_body_bytes`` (A): no body generated goes over it."""
SERVICE_MAX_BODY = 1024
SILENCE_S = 5.0
"""B reads until the server closes, or until this long passed without a byte."""
CLOSE_DEADLINE_S = 10.0
"""B: the server closes the connection within this long of the client's end of sending."""

_ERROR_LINE = re.compile(r" (ERROR|CRITICAL) ")


def _settings(examples: int) -> settings:
    return settings(
        max_examples=EXAMPLES or examples,
        deadline=None,
        database=None,  # repeatable: no replay of earlier runs' failures
        print_blob=True,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


# ================================================================== answers on the wire


@dataclass
class Answer:
    """One answer as read off the wire (header names in lower case)."""

    status: int
    fields: list[tuple[str, str]]
    body: bytes
    bodiless: bool = False

    def header(self, name: str) -> str | None:
        values = [value for key, value in self.fields if key == name]
        assert len(values) <= 1, (name, self.fields)
        return values[0] if values else None

    @property
    def closes(self) -> bool:
        value = self.header("connection")
        return value is not None and value.lower() == "close"


_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9][0-9]) [\x20-\x7e]*")
_FIELD_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+): ?([\x20-\x7e]*)")


def parse_head(head: bytes) -> tuple[int, list[tuple[str, str]]]:
    """The status and fields of an answer's head (without its blank line); asserts its
    shape: an HTTP/1.1 status line, then ``name: value`` lines."""
    lines = head.split(b"\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    assert status_line is not None, f"not an HTTP/1.1 status line: {lines[0]!r}"
    fields = []
    for line in lines[1:]:
        match = _FIELD_LINE.fullmatch(line)
        assert match is not None, f"not a header line: {line!r} in {head!r}"
        fields.append((match[1].decode().lower(), match[2].decode().strip()))
    return int(status_line[1]), fields


def content_length(status: int, fields: list[tuple[str, str]]) -> int:
    lengths = [value for key, value in fields if key == "content-length"]
    assert len(lengths) == 1 and lengths[0].isdigit(), (status, fields)
    return int(lengths[0])


def parse_stream(raw: bytes, *, head_sent: bool, reset: bool) -> list[Answer]:
    """Every answer in ``raw`` (all the server sent), interim ones included. An answer
    without its body is accepted where a HEAD was sent (``head_sent``) and its body
    would be missing or would start another answer; ``reset``: the last answer may be
    cut short (the connection was reset)."""
    answers: list[Answer] = []
    at = 0
    while at < len(raw):
        end = raw.find(b"\r\n\r\n", at)
        if end < 0 and reset:
            break
        assert end >= 0, f"an answer's head without its end: {raw[at:][:300]!r}"
        status, fields = parse_head(raw[at:end])
        at = end + 4
        if 100 <= status < 200:
            assert status == 100 and not fields, f"interim answer {status} {fields}"
            answers.append(Answer(status, fields, b""))
            continue
        length = content_length(status, fields)
        rest = raw[at:]
        if head_sent and length and (not rest or rest.startswith(b"HTTP/1.1 ")):
            answers.append(Answer(status, fields, b"", bodiless=True))
            continue
        if len(rest) < length and reset:
            break
        assert len(rest) >= length, f"a body cut short: {length} bytes announced, {rest!r}"
        answers.append(Answer(status, fields, rest[:length]))
        at += length
    return answers


# ============================================================ A: the in-process server


def echo(method: str, path: str, query: str, body: bytes) -> bytes:
    """The echo handler's answer body for a request."""
    digest = hashlib.sha256(body).hexdigest()
    return f"{method} {path} {query} {len(body)} {digest}".encode("latin-1")


class Echo(Recorder):
    """Answers every request at once with :func:`echo` of it (and records it)."""

    def head(self, request: Request) -> Response | None:
        self.heads.append(request.path)
        return None

    def handle(self, request: Request) -> Response:
        self.handled.append(request)
        return Response(
            200, echo(request.method, request.path, request.query, request.body), "text/plain"
        )


def origin_form(target: str) -> str:
    """An absolute-form target (``http://host/p?q``) as its path and query (``/p?q``)."""
    match = re.fullmatch(r"(?i:https?)://[^/?]*(.*)", target)
    if match is None:
        return target
    rest = match[1]
    return rest if rest.startswith("/") else "/" + rest


@dataclass(frozen=True)
class Sent:
    """One request as generated: its bytes and what a server must read from them."""

    raw: bytes
    method: str
    target: str
    version: Literal["1.0", "1.1"]
    headers: tuple[tuple[str, bytes], ...]  # the header section: (lower-case name, value)
    body: bytes
    closes: bool  # the request asks the server to close after its answer
    keep_alive_1_0: bool  # an HTTP/1.0 request with Connection: keep-alive

    def path_and_query(self) -> tuple[str, str]:
        """The path and query the handler sees (an absolute-form target's path)."""
        path, _, query = origin_form(self.target).partition("?")
        return path, query

    def echo(self) -> bytes:
        return echo(self.method, *self.path_and_query(), self.body)

    def expected_headers(self) -> dict[str, str]:
        """The request's headers as the server's handler must see them."""
        joined: dict[str, str] = {}
        for name, value in self.headers:
            text = value.decode("utf-8", "surrogateescape")
            joined[name] = text if name not in joined else f"{joined[name]}, {text}"
        return joined


@dataclass(frozen=True)
class Odd:
    """A request the server must refuse (``must_refuse``), or may refuse or serve."""

    kind: str
    raw: bytes
    must_refuse: bool
    refusals: frozenset[int]  # the statuses a refusal may have
    served: Sent | None  # what serving it looks like (None: it must not be served)


class Pipeline:
    """Requests as sent: ``pieces`` (bytes, and the pause after them), and the odd
    request (A2) at index ``odd_at`` of the requests (a plain class: hypothesis prints
    its repr)."""

    def __init__(
        self,
        requests: tuple[Sent, ...],
        odd_at: int | None,
        odd: Odd | None,
        pieces: tuple[tuple[bytes, float | None], ...],
    ) -> None:
        self.requests = requests
        self.odd_at = odd_at
        self.odd = odd
        self.pieces = pieces

    @property
    def raw(self) -> bytes:
        return b"".join(piece for piece, _ in self.pieces)

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        cuts = [len(piece) for piece, _ in self.pieces]
        odd = f" odd={self.odd.kind!r} at {self.odd_at}" if self.odd else ""
        return f"Pipeline({len(self.requests)} requests{odd}, pieces {cuts}, raw={self.raw!r})"


TCHAR = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
RESERVED = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "proxy-connection",
    "keep-alive",
    "upgrade",
    "expect",
    "te",
}
"""Header names that change framing or the connection: A sets them itself."""
PCHAR = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=:@"
VALUE_CHARS = [chr(c) for c in range(0x21, 0x7F)] + [" ", "\t", "\xe9", "\xff", "\x80"]

_names = st.text(TCHAR, min_size=1, max_size=12).filter(lambda n: n.lower() not in RESERVED)
_values = st.text(st.sampled_from(VALUE_CHARS), max_size=24).map(lambda v: v.strip(" \t"))
_ows = st.sampled_from(["", " ", " ", "  ", "\t"])
_segment = st.text(PCHAR, max_size=8) | st.sampled_from(["%41", "%2F", "%e2%82%ac"])
_path = st.lists(_segment, min_size=1, max_size=4).map(lambda s: "/" + "/".join(s))
_query = st.text(PCHAR + "/?", min_size=1, max_size=16)


def _case(draw: st.DrawFn, text: str) -> str:
    """``text`` in the case hypothesis picks: as is, lower, upper, or mixed."""
    style = draw(st.sampled_from(["as-is", "lower", "upper", "swap"]))
    if style == "lower":
        return text.lower()
    if style == "upper":
        return text.upper()
    return text.swapcase() if style == "swap" else text


def _field_line(draw: st.DrawFn, name: str, value: str, *, trailing_ows: bool = True) -> bytes:
    after = draw(_ows) if trailing_ows else ""
    return f"{name}:{draw(_ows)}{value}{after}\r\n".encode("latin-1")


def _body(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=48))
    size = draw(st.integers(0, ECHO_MAX_BODY) | st.sampled_from([ECHO_MAX_BODY - 1, ECHO_MAX_BODY]))
    start = draw(st.integers(0, 255))
    return bytes((start + i * 7) % 256 for i in range(size))


def _chunked(draw: st.DrawFn, body: bytes) -> tuple[bytes, list[tuple[str, str]]]:
    """``body`` in chunks (sizes, hex case, extensions, trailers drawn); the trailers."""
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=5))))
    bounds = [0, *(c for c in cuts if c < len(body)), len(body)]
    out = []
    for start, end in itertools.pairwise(bounds):
        if start == end:
            continue
        size = f"{end - start:x}"
        size = "0" * draw(st.integers(0, 2)) + _case(draw, size)
        ext = draw(st.sampled_from(["", ";a=b", ";x", ';n="q s"', ";a=1;b=2"]))
        out.append(f"{size}{ext}\r\n".encode() + body[start:end] + b"\r\n")
    last_ext = draw(st.sampled_from(["", ";e=1"]))
    out.append(f"0{last_ext}\r\n".encode())
    trailers = draw(st.lists(st.tuples(_names, _values), max_size=2))
    for name, value in trailers:
        out.append(_field_line(draw, name, value))
    out.append(b"\r\n")
    return b"".join(out), trailers


@st.composite
def requests(draw: st.DrawFn, *, last: bool = False, trailing_ows: bool = True) -> Sent:
    """One well-formed request (``last``: it may ask for the connection's close;
    ``trailing_ows``: whitespace after some field values)."""
    method = draw(st.sampled_from(["GET", "POST", "PUT", "HEAD", "DELETE"]))
    target = draw(_path)
    if draw(st.booleans()):
        target += "?" + draw(_query)
    if draw(st.integers(0, 9)) == 0:
        target = "http://example.com:8080" + target
    version: Literal["1.0", "1.1"] = "1.0" if draw(st.integers(0, 4)) == 0 else "1.1"
    closes = last and draw(st.integers(0, 3)) == 0
    fields: list[tuple[str, str, bytes]] = []  # (name as sent, value, line)

    def add(name: str, value: str) -> None:
        fields.append((name, value, _field_line(draw, name, value, trailing_ows=trailing_ows)))

    for name, value in draw(st.lists(st.tuples(_names, _values), max_size=5)):
        add(name, value)
    host = draw(st.sampled_from(["example.com", "127.0.0.1:8080", "t"]))
    fields.insert(draw(st.integers(0, len(fields))), (_case(draw, "Host"), host, b""))
    fields = [
        (n, v, line or _field_line(draw, n, v, trailing_ows=trailing_ows)) for n, v, line in fields
    ]
    keep_alive_1_0 = version == "1.0" and not closes
    if keep_alive_1_0:
        add(_case(draw, "Connection"), _case(draw, "keep-alive"))
    if closes and version == "1.1":
        add(_case(draw, "Connection"), _case(draw, "close"))
    framing = draw(st.sampled_from(["none", "length", "chunked"]))
    if version == "1.0" and framing == "chunked":
        framing = "length"
    body = b"" if framing == "none" else _body(draw)
    payload = body
    if framing == "length":
        add(_case(draw, "Content-Length"), "0" * draw(st.integers(0, 2)) + str(len(body)))
    elif framing == "chunked":
        # No tab after "chunked": llhttp refuses that Transfer-Encoding (a 400, never a
        # misframed body), where h11 reads it as chunked; a space both accept.
        name, value = _case(draw, "Transfer-Encoding"), _case(draw, "chunked")
        after = draw(st.sampled_from(["", " "])) if trailing_ows else ""
        fields.append((name, value, f"{name}:{draw(_ows)}{value}{after}\r\n".encode()))
        payload, _ = _chunked(draw, body)
    head = f"{method} {target} HTTP/{version}\r\n".encode() + b"".join(f[2] for f in fields)
    return Sent(
        raw=head + b"\r\n" + payload,
        method=method,
        target=target,
        version=version,
        headers=tuple((n.lower(), v.encode("latin-1")) for n, v, _ in fields),
        body=body,
        closes=closes,
        keep_alive_1_0=keep_alive_1_0,
    )


def _plain(method: str, target: str, *lines: str, body: bytes = b"") -> bytes:
    return (f"{method} {target} HTTP/1.1\r\n" + "".join(f"{x}\r\n" for x in lines)).encode() + (
        b"\r\n" + body
    )


@st.composite
def odd_requests(draw: st.DrawFn) -> Odd:
    kind = draw(
        st.sampled_from(
            ["no-host", "two-hosts", "version", "two-lengths", "folded", "upgrade", "connect"]
        )
    )
    refusal_4xx = frozenset(range(400, 500))
    if kind == "no-host":
        return Odd(kind, _plain("GET", "/odd", "X-A: b"), True, refusal_4xx, None)
    if kind == "two-hosts":
        raw = _plain("GET", "/odd", "Host: a.example", "Host: b.example")
        return Odd(kind, raw, True, refusal_4xx, None)
    if kind == "version":
        version = draw(st.sampled_from(["2.0", "3.0", "0.9"]))
        raw = f"GET /odd HTTP/{version}\r\nHost: t\r\n\r\n".encode()
        return Odd(f"version {version}", raw, True, refusal_4xx | {505}, None)
    if kind == "two-lengths":
        raw = _plain(
            "POST", "/odd", "Host: t", "Content-Length: 3", "Content-Length: 4", body=b"abcd"
        )
        return Odd(kind, raw, True, refusal_4xx, None)
    if kind == "folded":  # RFC 9112 5.2: refused with a 400, or unfolded (read as one SP)
        raw = _plain("GET", "/odd", "Host: t", "X-Folded: a", " b")
        served = Sent(
            raw, "GET", "/odd", "1.1", (("host", b"t"), ("x-folded", b"a b")), b"", False, False
        )
        return Odd(kind, raw, False, frozenset({400}), served)
    if kind == "upgrade":  # RFC 9110 7.8: a server MAY ignore Upgrade
        upgrade = draw(st.sampled_from(["websocket", "h2c", "TLS/1.2"]))
        raw = _plain("GET", "/odd", "Host: t", f"Upgrade: {upgrade}", "Connection: Upgrade")
        headers = (("host", b"t"), ("upgrade", upgrade.encode()), ("connection", b"Upgrade"))
        served = Sent(raw, "GET", "/odd", "1.1", headers, b"", False, False)
        return Odd(f"upgrade {upgrade}", raw, False, refusal_4xx, served)
    raw = _plain("CONNECT", "example.com:443", "Host: example.com:443")
    return Odd(kind, raw, True, refusal_4xx | {501}, None)


def _split(draw: st.DrawFn, raw: bytes) -> tuple[tuple[bytes, float | None], ...]:
    """``raw`` cut where hypothesis picks, with a pause (or none) after each piece."""
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(raw) - 1)), max_size=8))))
    bounds = [0, *(c for c in cuts if c < len(raw)), len(raw)]
    pauses = st.sampled_from([None, None, 0.0, 0.002])
    return tuple((raw[start:end], draw(pauses)) for start, end in itertools.pairwise(bounds))


@st.composite
def pipelines(draw: st.DrawFn, *, with_odd: bool = False) -> Pipeline:
    count = draw(st.integers(1, 8))
    # A2's requests around the odd one have no whitespace after their field values:
    # A finds what the server makes of it, and A2 looks at the odd request alone.
    sent = [draw(requests(last=n == count - 1, trailing_ows=not with_odd)) for n in range(count)]
    odd_at: int | None = None
    odd: Odd | None = None
    raws = [s.raw for s in sent]
    if with_odd:
        odd_at = draw(st.integers(0, count))
        odd = draw(odd_requests())
        if odd_at == count and sent[-1].closes:
            odd_at = count - 1  # before the closing request, so that it is read
        raws.insert(odd_at, odd.raw)
    return Pipeline(tuple(sent), odd_at, odd, _split(draw, b"".join(raws)))


@dataclass
class Oracle:
    """What h11 (as a server) reads from a byte string."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, bytes]]
    body: bytes = b""
    trailers: list[tuple[str, bytes]] = field(default_factory=list)


def h11_reads(raw: bytes) -> list[Oracle]:
    """The requests in ``raw`` as h11 reads them: a new cycle after each request
    (answered with an empty 200), a new connection on the bytes left after a request
    h11 does not keep alive (HTTP/1.0 with ``Connection: keep-alive``)."""
    found: list[Oracle] = []
    conn = h11.Connection(our_role=h11.SERVER)
    conn.receive_data(raw)
    conn.receive_data(b"")  # the client's end: a request cut short is an error
    current: Oracle | None = None
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            raise AssertionError("h11 needs more data after the end")
        if isinstance(ev, h11.ConnectionClosed):
            return found
        if isinstance(ev, h11.Request):
            current = Oracle(
                ev.method.decode("ascii"),
                ev.target.decode("latin-1"),
                ev.http_version.decode("ascii"),
                [(bytes(n).decode("ascii"), bytes(v)) for n, v in ev.headers],
            )
        elif isinstance(ev, h11.Data):
            assert current is not None
            current.body += bytes(ev.data)
        elif isinstance(ev, h11.EndOfMessage):
            assert current is not None
            current.trailers = [(bytes(n).decode("ascii"), bytes(v)) for n, v in ev.headers]
            found.append(current)
            current = None
            conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            else:  # HTTP/1.0: h11 does not do its keep-alive; read on afresh
                rest, _ = conn.trailing_data
                conn = h11.Connection(our_role=h11.SERVER)
                conn.receive_data(bytes(rest))
                conn.receive_data(b"")
        elif ev is h11.PAUSED:
            raise AssertionError(f"h11 paused in {conn.states}")


def check_oracle(sent: Sequence[Sent], raw: bytes) -> None:
    """The test's own check: h11 reads from ``raw`` the requests generated."""
    oracle = h11_reads(raw)
    assert [(o.method, o.target, o.body) for o in oracle] == [
        (s.method, s.target, s.body) for s in sent
    ], "h11 disagrees with the generator (a bug of the test)"
    for o, s in zip(oracle, sent, strict=True):
        # h11 gives Transfer-Encoding's value in lower case (it reads it so).
        wanted = [(n, v.lower() if n == "transfer-encoding" else v) for n, v in s.headers]
        assert o.headers == wanted, (o.headers, s.headers)


class ErrorLog(logging.Handler):
    """Records logged at ERROR or above by the server or the event loop."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def no_errors_logged() -> Iterator[None]:
    handler = ErrorLog()
    loggers = [logging.getLogger("dedup"), logging.getLogger("asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records]


class Wire:
    """The client's end of one connection to the in-process server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, pieces: Sequence[tuple[bytes, float | None]]) -> None:
        for piece, pause in pieces:
            self.writer.write(piece)
            await asyncio.wait_for(self.writer.drain(), DEADLINE_S)
            if pause is not None:
                await asyncio.sleep(pause)

    async def answer(self, *, head_only: bool) -> Answer:
        """The next final answer (there is no interim one in A)."""

        async def read() -> Answer:
            head = await self.reader.readuntil(b"\r\n\r\n")
            status, fields = parse_head(head[:-4])
            assert status >= 200, (status, fields)
            length = content_length(status, fields)
            if head_only:
                return Answer(status, fields, b"", bodiless=True)
            return Answer(status, fields, await self.reader.readexactly(length))

        try:
            return await asyncio.wait_for(read(), DEADLINE_S)
        except asyncio.IncompleteReadError as exc:
            raise AssertionError(f"the connection ended; partial answer {exc.partial!r}") from None

    async def end(self) -> None:
        """The server closes the connection, with nothing more sent."""
        rest = await asyncio.wait_for(self.reader.read(), DEADLINE_S)
        assert rest == b"", f"sent after the last answer: {rest!r}"


def check_answer(answer: Answer, sent: Sent) -> None:
    """``answer`` is the echo of ``sent``, with the Connection header it asked for."""
    expected = sent.echo()
    assert answer.status == 200, (answer.status, answer.body)
    if sent.method == "HEAD":
        assert answer.header("content-length") == str(len(expected))
    else:
        assert answer.body == expected, f"answer {answer.body!r}, expected {expected!r}"
    connection = answer.header("connection")
    if sent.closes:
        assert connection is not None and connection.lower() == "close", answer.fields
    elif sent.keep_alive_1_0:
        assert connection is not None and connection.lower() == "keep-alive", answer.fields
    else:
        assert connection is None, answer.fields


def check_handled(handled: Sequence[Request], sent: Sequence[Sent], *, headers: bool) -> None:
    """The handler saw these requests: method, target and body first, then (``headers``)
    their header fields."""
    seen = [(r.method, r.path, r.query, r.body) for r in handled]
    wanted = [(s.method, *s.path_and_query(), s.body) for s in sent]
    assert seen == wanted
    for request, s in zip(handled, sent, strict=True):
        assert request.version == s.version, (request.version, s.version)
        if headers:
            assert request.headers == s.expected_headers(), f"{s.target}: headers differ"


async def _exchange(pipeline: Pipeline) -> None:
    handler = Echo(max_body_bytes=ECHO_MAX_BODY)
    async with serving(handler) as (_, port):
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), DEADLINE_S
        )
        wire = Wire(reader, writer)
        try:
            await wire.send(pipeline.pieces)
            before = list(pipeline.requests)
            after: list[Sent] = []
            if pipeline.odd_at is not None:
                before, after = before[: pipeline.odd_at], before[pipeline.odd_at :]
            for sent in before:
                check_answer(await wire.answer(head_only=sent.method == "HEAD"), sent)
            served = list(before)
            refused_and_closed = False
            if pipeline.odd is not None:
                odd = pipeline.odd
                answer = await wire.answer(head_only=False)
                event(f"A2: {odd.kind} answered {answer.status}")
                if answer.status in odd.refusals:
                    if answer.closes:
                        after = []  # nothing of the rest is read
                        refused_and_closed = True
                elif odd.served is not None:
                    check_answer(answer, odd.served)
                    served.append(odd.served)
                else:
                    raise AssertionError(
                        f"{odd.kind}: answered {answer.status} {answer.body!r}, "
                        f"expected one of {sorted(odd.refusals)}"
                    )
            for sent in after:
                check_answer(await wire.answer(head_only=sent.method == "HEAD"), sent)
            served += after
            if refused_and_closed or (served and served[-1].closes):
                await wire.end()  # closed by the server itself
            writer.write_eof()
            await wire.end()
            # A2 leaves the header fields to A: only the framing of the rest is checked.
            check_handled(handler.handled, served, headers=pipeline.odd is None)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(writer.wait_closed(), DEADLINE_S)


@seed(SEED)
@_settings(45)
@given(pipeline=pipelines())
def test_a_pipelined_requests_are_framed_as_h11_frames_them(pipeline: Pipeline) -> None:
    note(repr(pipeline))
    check_oracle(pipeline.requests, pipeline.raw)
    with no_errors_logged():
        asyncio.run(_exchange(pipeline))


@seed(SEED)
@_settings(40)
@given(pipeline=pipelines(with_odd=True))
def test_a2_one_odd_request_in_a_pipeline_gets_one_answer(pipeline: Pipeline) -> None:
    note(repr(pipeline))
    with no_errors_logged():
        asyncio.run(_exchange(pipeline))


# ================================================================ B: the real service


@pytest.fixture(scope="module")
def service(
    pg_cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """One ``python -m dedup serve`` for the module, on its own redis-server and
    database, with a small body limit and no token (every route is reached)."""
    name = f"fuzz_bytes_{os.getpid()}"
    url = pg_cluster.create_database(name)
    with service_on_own_servers(
        pg_cluster,
        tmp_path_factory.mktemp("fuzz-bytes"),
        name,
        url,
        DEDUP_MAX_BODY_BYTES=str(SERVICE_MAX_BODY),
        DEDUP_MAX_BATCH_ITEMS="5",
    ) as (svc, _):
        start = len(svc.log_text())
        yield svc
        # Last: what the examples left in the log, late lines included.
        added = svc.log_text()[start:]
        assert "Traceback" not in added and not _ERROR_LINE.search(added), added[-5000:]


_kinds = st.sampled_from(["fz", "fz2", "k"])
_save_values = st.text('abcxyz01é"\\', max_size=6)


@st.composite
def _service_request(draw: st.DrawFn) -> bytes:
    """One valid-looking request to one of the service's routes."""
    route = draw(
        st.sampled_from(["healthz", "readyz", "openapi", "metrics", "save", "batch", "unknown"])
    )
    extra = draw(
        st.sampled_from(
            ["", "", "", "Connection: keep-alive\r\n", "X-Fuzz: 1\r\n", "Connection: close\r\n"]
        )
    )
    if route in ("healthz", "readyz", "openapi", "metrics"):
        method = draw(st.sampled_from(["GET", "GET", "HEAD"]))
        path = {"openapi": "/openapi.json"}.get(route, "/" + route)
        return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()
    if route == "unknown":
        method = draw(st.sampled_from(["GET", "POST", "HEAD", "DELETE"]))
        return f"{method} /v1/nowhere HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()
    item = (draw(_kinds), draw(_save_values))
    if route == "save":
        path, body = "/v1/save", json_item(*item)
    else:
        items = [item, *draw(st.lists(st.tuples(_kinds, _save_values), max_size=2))]
        path = "/v1/save/batch"
        body = b'{"items": [' + b", ".join(json_item(*i) for i in items) + b"]}"
    expect = "Expect: 100-continue\r\n" if draw(st.integers(0, 5)) == 0 else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{expect}{extra}\r\n"
    )
    return head.encode() + body


def json_item(kind: str, value: str) -> bytes:
    return json.dumps({"kind": kind, "value": value}).encode()


_NASTY = [b"\r", b"\n", b"\r\n", b" ", b"\t", b":", b"\x00", b"\xff", b"0", b"9", b";", b"/"]
_CONTENT_LENGTHS = ["-1", "abc", "99999999999999999999", "1 2", "0x10", "", "+5", "5, 5", "0"]
_ADDED_HEADERS = [
    "Transfer-Encoding: chunked",
    "Transfer-Encoding: gzip, chunked",
    "Transfer-Encoding: chunked, identity",
    "Upgrade: websocket\r\nConnection: Upgrade",
    "Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAA",
    "Connection: close",
    "Expect: 100-continue",
    "Content-Length: 3",
    "Host: second",
    "Connection: keep-alive",
]
_VERSIONS = ["HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.2", "HTTP/3.0", "HTTP/1.10", "http/1.1"]
_BAD_CHUNKS = [
    b"zz\r\n{}\r\n0\r\n\r\n",
    b"ffffffffffffffffffff\r\n{}\r\n",
    b"-1\r\n{}\r\n0\r\n\r\n",
    b"2\r\n{}0\r\n\r\n",
    b"5\r\n{}\r\n",
    b"2\r\n{}\r\n",
    b"2;a\x00b\r\n{}\r\n0\r\n\r\n",
    b"0\r\nBad Trailer\r\n\r\n",
    b"1\r\n{\r\n1\r\n}\r\n0\r\n\r\n",
]
_REQUEST_LINE = re.compile(rb"(?m)^([A-Za-z]+) (\S+) (HTTP/\d\.\d)\r$")


def _nth(draw: st.DrawFn, pattern: re.Pattern[bytes], buf: bytes) -> re.Match[bytes] | None:
    found = list(pattern.finditer(buf))
    return found[draw(st.integers(0, len(found) - 1))] if found else None


def _mutate(draw: st.DrawFn, buf: bytes) -> bytes:
    """One byte-level mutation of ``buf``, chosen by hypothesis."""
    # The structured mutations (headers, versions, methods, Host, chunks) twice as often
    # as each kind of byte noise: they reach the server's own decisions.
    kind = draw(st.sampled_from([0, 1, 2, 3, 4, 5, *[6, 7, 7, 8, 9, 10, 11, 12, 13] * 2]))
    at = draw(st.integers(0, len(buf)))
    if kind == 0:  # insert bytes
        return (
            buf[:at] + draw(st.sampled_from(_NASTY) | st.binary(min_size=1, max_size=6)) + buf[at:]
        )
    if kind == 1:  # delete a few
        return buf[:at] + buf[at + draw(st.integers(1, 8)) :]
    if kind == 2 and buf:  # replace a byte
        at = min(at, len(buf) - 1)
        return buf[:at] + bytes([draw(st.integers(0, 255))]) + buf[at + 1 :]
    if kind == 3:  # duplicate a range
        span = buf[at : at + draw(st.integers(1, 40))]
        return buf[:at] + span + buf[at:]
    if kind in (4, 5):  # drop or double a CRLF
        found = _nth(draw, re.compile(rb"\r\n"), buf)
        if found is None:
            return buf
        middle = b"" if kind == 4 else b"\r\n\r\n"
        return buf[: found.start()] + middle + buf[found.end() :]
    if kind == 6:  # corrupt a Content-Length
        found = _nth(draw, re.compile(rb"Content-Length: ([^\r]*)"), buf)
        if found is None:
            return buf
        value = draw(st.sampled_from(_CONTENT_LENGTHS) | st.integers(0, 2000).map(str))
        return buf[: found.start(1)] + value.encode() + buf[found.end(1) :]
    if kind == 7:  # add a header line after a request line
        found = _nth(draw, _REQUEST_LINE, buf)
        if found is None:
            return buf
        line = draw(st.sampled_from(_ADDED_HEADERS)).encode() + b"\r\n"
        return buf[: found.end() + 1] + line + buf[found.end() + 1 :]
    if kind == 8:  # another version
        found = _nth(draw, _REQUEST_LINE, buf)
        if found is None:
            return buf
        version = draw(st.sampled_from(_VERSIONS)).encode()
        return buf[: found.start(3)] + version + buf[found.end(3) :]
    if kind == 9:  # absolute-form target
        found = _nth(draw, _REQUEST_LINE, buf)
        if found is None or not found[2].startswith(b"/"):
            return buf
        return buf[: found.start(2)] + b"http://x" + buf[found.start(2) :]
    if kind == 10:  # another method
        found = _nth(draw, _REQUEST_LINE, buf)
        if found is None:
            return buf
        method = draw(st.sampled_from([b"CONNECT", b"PRI", b"OPTIONS", b"get", b"TRACE", b"GET "]))
        target = b"x:443" if method == b"CONNECT" else found[2]
        return buf[: found.start(1)] + method + b" " + target + buf[found.end(2) :]
    if kind == 11:  # no Host
        found = _nth(draw, re.compile(rb"Host: [^\r]*\r\n"), buf)
        return buf if found is None else buf[: found.start()] + buf[found.end() :]
    if kind == 12:  # a body sent chunked, badly
        found = _nth(draw, re.compile(rb"Content-Length: ([0-9]+)\r\n((?:[^\r]+\r\n)*)\r\n"), buf)
        if found is None:
            return buf
        length = int(found[1])
        body = buf[found.end() : found.end() + length]
        chunks = draw(st.sampled_from(_BAD_CHUNKS)).replace(b"{}", body)
        head = b"Transfer-Encoding: chunked\r\n" + found[2] + b"\r\n"
        return buf[: found.start()] + head + chunks + buf[found.end() + length :]
    # a chunked body, well formed
    found = _nth(draw, re.compile(rb"Content-Length: ([0-9]+)\r\n((?:[^\r]+\r\n)*)\r\n"), buf)
    if found is None:
        return buf
    length = int(found[1])
    body = buf[found.end() : found.end() + length]
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    head = b"Transfer-Encoding: chunked\r\n" + found[2] + b"\r\n"
    return buf[: found.start()] + head + chunked + buf[found.end() + length :]


class Mutated:
    """The bytes B sends, in pieces (a plain class: hypothesis prints its repr)."""

    def __init__(self, pieces: tuple[tuple[bytes, float | None], ...]) -> None:
        self.pieces = pieces

    @property
    def raw(self) -> bytes:
        return b"".join(piece for piece, _ in self.pieces)

    def __repr__(self) -> str:
        return f"Mutated(pieces {[len(p) for p, _ in self.pieces]}, raw={self.raw!r})"


@st.composite
def mutated(draw: st.DrawFn) -> Mutated:
    buf = b"".join(draw(st.lists(_service_request(), min_size=1, max_size=5)))
    for _ in range(draw(st.integers(0, 4))):
        buf = _mutate(draw, buf)
    return Mutated(_split(draw, buf))


@dataclass
class Exchange:
    sent: bytes
    received: bytes
    ended: bool  # the server closed the connection (EOF) within the bound
    reset: bool  # the connection was reset


def exchange(port: int, pieces: Sequence[tuple[bytes, float | None]]) -> Exchange:
    """Send ``pieces``, shut the sending side, read until the server closes (or
    :data:`SILENCE_S` without a byte, or :data:`CLOSE_DEADLINE_S` in all)."""
    sent = bytearray()
    received = bytearray()
    ended = reset = False
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece, pause in pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                reset = True
                break
            sent += piece
            if pause is not None:
                time.sleep(pause)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + CLOSE_DEADLINE_S
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, min(SILENCE_S, deadline - time.monotonic())))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                reset = True
                break
            if not chunk:
                ended = True
                break
            received += chunk
    return Exchange(bytes(sent), bytes(received), ended, reset)


def healthz(port: int) -> int:
    """The status of ``GET /healthz`` on a new connection."""
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        sock.sendall(request)
        raw = bytearray()
        while chunk := sock.recv(65536):
            raw += chunk
    answers = parse_stream(bytes(raw), head_sent=False, reset=False)
    assert len(answers) == 1, raw
    return answers[0].status


REFUSALS_5XX = {501: ("not_implemented", b"CONNECT "), 505: ("http_version_not_supported", b"")}
"""The 5xx the server answers by design, its refusals of a request it will not serve
(http.py's docstring): 501 to ``CONNECT`` (it is not a proxy), 505 to a version other
than 1.x; each with its JSON error code, and the connection closed after it. Any other
5xx (500, 503...) is a failure."""


def documented_refusal(answer: Answer, sent: bytes) -> bool:
    """``answer`` is one of :data:`REFUSALS_5XX`, to a request that was sent."""
    if answer.status not in REFUSALS_5XX or not answer.closes:
        return False
    code, method = REFUSALS_5XX[answer.status]
    return method in sent and f'"code":"{code}"'.encode() in answer.body.replace(b" ", b"")


def check_exchange(done: Exchange) -> None:
    answers = parse_stream(done.received, head_sent=b"HEAD " in done.sent, reset=done.reset)
    final = [a for a in answers if a.status >= 200]
    event(f"B: {len(final)} answers, statuses {sorted({a.status for a in final})}")
    for a in final:
        assert a.status < 500 or documented_refusal(a, done.sent), (a.status, a.body)
    for a in answers[:-1]:
        assert not a.closes, "an answer after one carrying Connection: close"
    heads = done.sent.count(b"\r\n\r\n")
    unterminated = not done.sent.endswith(b"\r\n\r\n")
    allowed = heads + (1 if final and final[-1].closes and unterminated else 0)
    assert len(final) <= allowed, (
        f"{len(final)} answers to {heads} request heads: {[a.status for a in final]}"
    )
    assert done.ended or done.reset, (
        f"the server did not close within {CLOSE_DEADLINE_S} s of the client's end"
    )


@seed(SEED)
@_settings(60)
@given(case=mutated())
def test_b_mutated_requests_never_break_the_service(service: ServiceProcess, case: Mutated) -> None:
    note(repr(case))
    log_start = len(service.log_text())
    done = exchange(service.port, case.pieces)
    note(f"received {done.received!r} ended={done.ended} reset={done.reset}")
    check_exchange(done)
    assert healthz(service.port) == 200
    assert service.proc.poll() is None, "the service exited"
    added = service.log_text()[log_start:]
    assert "Traceback" not in added and not _ERROR_LINE.search(added), added[:3000]
