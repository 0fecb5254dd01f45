"""The HTTP idempotency rules that :mod:`dedup.asgi`, :mod:`dedup.aiohttp` and
:mod:`dedup.wsgi` share, after the IETF draft "The Idempotency-Key HTTP Header
Field" (draft-ietf-httpapi-idempotency-key-header) and the practice of Stripe's API
and AWS Lambda Powertools:

* which requests are guarded (``methods``) and what a missing key gets (400 with
  ``require_key``);
* the request's key: the header's value, unquoted, scoped by ``scope(request)``;
* the fingerprint stored with the key (method, path, query and a digest of the body
  by default; :func:`json_fingerprint` leaves fields of a JSON body out);
* what is stored (:meth:`Idempotency.stores`): 2xx and 3xx, 4xx unless
  ``store_4xx=False`` (never 408, 409, 425 or 429), never 5xx or an exception;
* the record encoding (the JSON payload of the key's row in ``dedup_items``);
* the answers: a replay of the stored response with ``Idempotent-Replayed: true``,
  422 for a reused key, 409 with Retry-After while the key is in flight, and every
  error of the middleware itself as an RFC 9457 ``application/problem+json`` body.

The claim, the lease and its release are those of :meth:`dedup.Gateway.once`
(:func:`dedup._engine.once.begin`): a key runs at most once fleet-wide while its runner
lives, a response that must not be stored releases the lease, and the next request
with the key runs the handler again. The framework modules only translate requests
and responses.
"""

from __future__ import annotations

import base64
import hashlib
import http
import inspect
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import orjson

from dedup._engine.once import Lease, begin
from dedup._replay_cache import Entry, ReplayCache
from dedup._values import encode_payload, validate_kind, validate_value
from dedup.errors import DedupError, InvalidInput, Unavailable, WaitTimeout
from dedup.urls import redact

if TYPE_CHECKING:
    from dedup.gateway import Gateway

__all__ = [
    "BODY_OMITTED_HEADER",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_REPLAY_CACHE_BYTES",
    "DEFAULT_REPLAY_CACHE_S",
    "DEFAULT_REPLAY_CACHE_SIZE",
    "NEVER_STORED",
    "REPLAYED_HEADER",
    "Capture",
    "Fingerprint",
    "Idempotency",
    "Options",
    "ReplayCache",
    "RequestInfo",
    "Response",
    "call_maybe",
    "default_fingerprint",
    "json_fingerprint",
    "problem",
]

log = logging.getLogger("dedup")

REPLAYED_HEADER = "Idempotent-Replayed"
"""Set to ``true`` on a replayed response (the name Stripe and the draft's examples use)."""

BODY_OMITTED_HEADER = "Idempotent-Body-Omitted"
"""Set to ``true`` on a replay whose first body was over ``max_response_bytes``: the
status and headers are the first response's, the body is empty."""

NEVER_STORED = frozenset({408, 409, 425, 429})
"""4xx answers that say "try again" (timeout, conflict, too early, too many requests):
never stored, so a retry runs the handler."""

DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024
"""Bodies up to this size are stored for replay: as base64 it still fits the
Gateway's default ``max_payload_bytes`` (64 KiB) with room for the headers."""

DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
"""A guarded request's body is read (to fingerprint it) up to this size; a larger
one gets 413. aiohttp's own ``client_max_size`` default is the same."""

DEFAULT_REPLAY_CACHE_SIZE = 4096
"""Stored responses a middleware keeps in process for replays, at most (0: none)."""

DEFAULT_REPLAY_CACHE_BYTES = 8 * 1024 * 1024
"""Bytes of bodies and headers a middleware's replay cache holds, at most."""

DEFAULT_REPLAY_CACHE_S = 60.0
"""Seconds a stored response is replayed from the cache after it was put there; then
the next replay reads the row again."""

_ALWAYS_KEPT = ("content-type", "location")
_RECORD_VERSION = 1
# The fixed text of a 503, by the failing component (Unavailable.component).
_UNAVAILABLE = {"redis": "Redis is unavailable", "database": "the database is unavailable"}
_PROBLEM_TYPE = "application/problem+json"
_JSON_TYPE = (("Content-Type", "application/json"),)

Mode = Literal["replay", "ingest"]
InFlight = Literal["reject", "wait"]


class Options(TypedDict, total=False):
    """The options the three middlewares share, each described at :class:`Idempotency`."""

    kind: str
    header: str
    mode: Mode
    fingerprint: Fingerprint | None
    methods: Iterable[str]
    require_key: bool
    in_flight: InFlight
    store_4xx: bool
    max_response_bytes: int
    max_request_bytes: int
    replay_headers: Iterable[str]
    duplicate_status: int
    retry_after_s: int
    replay_cache_size: int
    replay_cache_bytes: int
    replay_cache_s: float


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a fingerprint sees of a request: ``method`` (upper case), ``path`` (decoded,
    with the app's root path), ``query`` (the raw query string) and ``body`` (bytes)."""

    method: str
    path: str
    query: str
    body: bytes


Fingerprint = Callable[[RequestInfo], "bytes | str"]
"""Maps a request to the bytes (or text) whose SHA-256 digest is its fingerprint."""


def default_fingerprint(request: RequestInfo) -> bytes:
    """Method, path, query string and the SHA-256 digest of the body."""
    return _default_fingerprint(request.method, request.path, request.query, request.body)


def _default_fingerprint(method: str, path: str, query: str, body: bytes) -> bytes:
    # default_fingerprint of a request given by its parts (the middlewares need no
    # RequestInfo for it).
    body_digest = hashlib.sha256(body).hexdigest()
    return "\n".join((method, path, query, body_digest)).encode()


def json_fingerprint(*, ignore: Iterable[str] = ()) -> Fingerprint:
    """A fingerprint like :func:`default_fingerprint` whose body part is the JSON body
    with the top-level fields ``ignore`` left out (keys sorted, so field order does
    not count either); a body that is not a JSON object counts as its raw bytes.

    For clients that put a timestamp or a retry counter in the body of a retry::

        DedupMiddleware(app, gateway=gw, fingerprint=json_fingerprint(ignore=["sent_at"]))
    """
    if isinstance(ignore, str):
        raise InvalidInput("ignore is a list of field names, not one string", field="ignore")
    left_out = frozenset(ignore)
    if not all(isinstance(name, str) for name in left_out):
        raise InvalidInput("ignore holds field names (str)", field="ignore")

    def fingerprint(request: RequestInfo) -> bytes:
        body = request.body
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            kept = {k: v for k, v in data.items() if k not in left_out}
            body = orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)
        return default_fingerprint(RequestInfo(request.method, request.path, request.query, body))

    return fingerprint


@dataclass(frozen=True, slots=True)
class Response:
    """A response as the middlewares store, replay and send it: ``body`` None means
    "over ``max_response_bytes``, not stored" (sent as an empty body)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes | None

    def wire_headers(self) -> list[tuple[str, str]]:
        """The headers to send, with a Content-Length for the body."""
        return [*self.headers, ("Content-Length", str(len(self.body or b"")))]

    def status_line(self) -> str:
        """``"201 Created"``: the status as WSGI wants it."""
        try:
            phrase = http.HTTPStatus(self.status).phrase
        except ValueError:
            phrase = "Unknown"
        return f"{self.status} {phrase}"


def problem(
    status: int, code: str, detail: str, headers: tuple[tuple[str, str], ...] = ()
) -> Response:
    """An RFC 9457 problem answer of the middleware itself; ``code`` (the ``error``
    member) names the problem for programs: ``missing_key``, ``invalid_key``,
    ``key_mismatch``, ``in_progress``, ``body_too_large``, ``unavailable``."""
    body = {
        "type": "about:blank",
        "title": http.HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "error": code,
    }
    return Response(status, (("Content-Type", _PROBLEM_TYPE), *headers), orjson.dumps(body))


class Capture:
    """A handler's response as it is sent: status, headers, and the body while it stays
    within ``limit`` bytes (past it, the body is dropped and :attr:`body` is None)."""

    __slots__ = ("_chunks", "_limit", "_size", "headers", "status")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._chunks: list[bytes] | None = []
        self._size = 0
        self.status: int | None = None
        self.headers: tuple[tuple[str, str], ...] = ()

    def start(self, status: int, headers: Iterable[tuple[str, str]]) -> None:
        """The response's status and headers."""
        self.status = status
        self.headers = tuple(headers)

    def add(self, chunk: bytes) -> None:
        """A piece of the body."""
        if self._chunks is None or not chunk:
            return
        self._size += len(chunk)
        if self._size > self._limit:
            self._chunks = None  # over the cap: status and headers only
        else:
            self._chunks.append(bytes(chunk))

    @property
    def body(self) -> bytes | None:
        """The body so far, or None once it went over the limit."""
        return None if self._chunks is None else b"".join(self._chunks)


_Record = tuple[str | None, Response] | None
"""A stored record, decoded: (fingerprint, response), or None for a key saved without one."""


class Idempotency:
    """The validated options of one middleware and the rules it applies.

    The options (shared by the three middlewares; see the status table in docs/embedding.md):

    - ``kind="request"``: the kind the keys are saved under (one row per key in
      ``dedup_items``; retention is the Gateway's, see docs/embedding.md).
    - ``header="Idempotency-Key"``; ``key`` and ``scope`` are the framework's
      callables, kept here as given.
    - ``mode="replay"``: store and replay responses; ``"ingest"`` only drops repeats
      of a 2xx: a repeat gets ``duplicate_status`` (200) with ``{"duplicate": true}``.
    - ``fingerprint``: a :data:`Fingerprint`, default :func:`default_fingerprint`;
      None stores none (a reused key is then replayed, never 422).
    - ``methods=("POST", "PATCH")``: the methods guarded; others pass through.
    - ``require_key=False``: True answers 400 to a guarded request without a key.
    - ``in_flight="reject"``: 409 with Retry-After while the key is being handled;
      ``"wait"`` waits (at most the Gateway's ``wait_timeout_s``) and replays.
    - ``store_4xx=True``: store 4xx answers (never 408, 409, 425, 429).
    - ``max_response_bytes``: bodies up to this size are stored (32 KiB).
    - ``max_request_bytes``: a guarded body is read up to this size, else 413 (1 MiB).
    - ``replay_headers=()``: response headers kept besides Content-Type and Location.
    - ``retry_after_s=1``: the Retry-After of a 409 and a 503.
    - ``replay_cache_size=4096``, ``replay_cache_bytes=8 MiB``, ``replay_cache_s=60``:
      the bounds of the in-process cache of stored responses (:class:`ReplayCache`),
      which answers replays without Redis or the database; ``replay_cache_size=0``
      turns it off.
    """

    __slots__ = ("cache", "duplicate_status", "fingerprinter", "header", "in_flight", "key",
                 "kind", "max_request_bytes", "max_response_bytes", "methods", "mode",
                 "replay_headers", "require_key", "retry_after", "scope",
                 "store_4xx")  # fmt: skip

    def __init__(
        self,
        *,
        kind: str = "request",
        header: str = "Idempotency-Key",
        key: Callable[..., Any] | None = None,
        scope: Callable[..., Any] | None = None,
        mode: Mode = "replay",
        fingerprint: Fingerprint | None = default_fingerprint,
        methods: Iterable[str] = ("POST", "PATCH"),
        require_key: bool = False,
        in_flight: InFlight = "reject",
        store_4xx: bool = True,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        replay_headers: Iterable[str] = (),
        duplicate_status: int = 200,
        retry_after_s: int = 1,
        replay_cache_size: int = DEFAULT_REPLAY_CACHE_SIZE,
        replay_cache_bytes: int = DEFAULT_REPLAY_CACHE_BYTES,
        replay_cache_s: float = DEFAULT_REPLAY_CACHE_S,
    ) -> None:
        self.kind = validate_kind(kind)
        if not isinstance(header, str) or not header.strip():
            raise InvalidInput("header must be a header name", field="header")
        self.header = header.strip()
        for name, fn in (("key", key), ("scope", scope), ("fingerprint", fingerprint)):
            if fn is not None and not callable(fn):
                raise InvalidInput(f"{name} must be a callable", field=name)
        self.key = key
        self.scope = scope
        self.fingerprinter = fingerprint
        if mode not in ("replay", "ingest"):
            raise InvalidInput('mode must be "replay" or "ingest"', field="mode")
        self.mode: Mode = mode
        if in_flight not in ("reject", "wait"):
            raise InvalidInput('in_flight must be "reject" or "wait"', field="in_flight")
        self.in_flight: InFlight = in_flight
        if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
            raise InvalidInput('methods is a list of method names, e.g. ["POST"]', field="methods")
        self.methods = frozenset(m.upper() for m in methods)
        if isinstance(replay_headers, str) or not all(isinstance(h, str) for h in replay_headers):
            raise InvalidInput("replay_headers is a list of header names", field="replay_headers")
        self.replay_headers = frozenset((*_ALWAYS_KEPT, *(h.lower() for h in replay_headers)))
        self.require_key = _flag(require_key, "require_key")
        self.store_4xx = _flag(store_4xx, "store_4xx")
        self.max_response_bytes = _whole(max_response_bytes, "max_response_bytes", 0)
        self.max_request_bytes = _whole(max_request_bytes, "max_request_bytes", 1)
        self.retry_after = str(_whole(retry_after_s, "retry_after_s", 0))
        if type(duplicate_status) is not int or not 200 <= duplicate_status <= 299:
            raise InvalidInput("duplicate_status must be a 2xx status", field="duplicate_status")
        self.duplicate_status = duplicate_status
        if (
            type(replay_cache_s) not in (int, float)
            or replay_cache_s <= 0
            or not math.isfinite(replay_cache_s)
        ):
            raise InvalidInput("replay_cache_s must be a number > 0", field="replay_cache_s")
        self.cache = ReplayCache(
            _whole(replay_cache_size, "replay_cache_size", 0),
            _whole(replay_cache_bytes, "replay_cache_bytes", 0),
            float(replay_cache_s),
        )

    # ------------------------------------------------------------ the request side

    def guards(self, method: str) -> bool:
        """Whether requests of ``method`` are guarded (the others pass through)."""
        return method.upper() in self.methods

    def missing_key(self) -> Response | None:
        """The answer to a guarded request without a key: 400 with ``require_key``,
        else None (the request passes through untouched)."""
        if not self.require_key:
            return None
        return problem(400, "missing_key", f"this request needs an {self.header} header")

    @staticmethod
    def key_from_header(raw: str | None) -> str | None:
        """The key in a header value: stripped, and unquoted when it is the draft's
        quoted sf-string form (``"abc"`` and ``abc`` are the same key); None if empty."""
        if raw is None:
            return None
        text = raw.strip()
        if len(text) >= 2 and text[0] == text[-1] == '"':
            text = text[1:-1]
        return text or None

    @property
    def reads_body(self) -> bool:
        """Whether a guarded request's body is read before the handler (to fingerprint it)."""
        return self.mode == "replay" and self.fingerprinter is not None

    def body_too_large(self, size: int) -> Response | None:
        """413 when a body of ``size`` bytes is over ``max_request_bytes``."""
        if size <= self.max_request_bytes:
            return None
        return problem(
            413,
            "body_too_large",
            f"a request with an idempotency key may have at most {self.max_request_bytes} "
            "bytes of body",
        )

    def fingerprint(self, request: RequestInfo) -> str | None:
        """The hex SHA-256 of the request's fingerprint, or None without one."""
        if not self.reads_body or self.fingerprinter is None:
            return None
        raw = self.fingerprinter(request)
        if isinstance(raw, str):
            raw = raw.encode()
        if not isinstance(raw, bytes | bytearray):
            raise TypeError("a fingerprint function returns bytes or str")
        return hashlib.sha256(raw).hexdigest()

    def fingerprint_of(self, method: str, path: str, query: str, body: bytes) -> str | None:
        """:meth:`fingerprint` of a request given by its parts."""
        if self.fingerprinter is default_fingerprint and self.reads_body:
            return hashlib.sha256(_default_fingerprint(method, path, query, body)).hexdigest()
        return self.fingerprint(RequestInfo(method, path, query, body))

    def value(self, key: str, scope: str | None) -> str:
        """The Gateway value of ``key`` in ``scope``: ``"<len(scope)>:<scope>:<key>"``, the
        scope's length first, so no pair of (scope, key) can spell another's.

        With a ``scope`` function, a request it gives no scope (None or ``""``) is
        encoded the same way, as ``"0::<key>"``: were its raw key used, a client without
        a scope could send ``Idempotency-Key: 3:abc:x`` and reach tenant ``abc``'s key
        ``x``. Only without a scope function is the raw key the value (so the keys that
        unscoped middlewares stored stay valid).
        """
        if scope is not None and not isinstance(scope, str):
            raise InvalidInput("scope(request) must return a str or None", field="scope")
        if self.scope is None and not scope:
            return key
        scope = scope or ""
        return f"{len(scope)}:{scope}:{key}"

    # -------------------------------------------------------------- forgetting

    def forgotten_value(self, key: str, scope: str | None) -> str:
        """The Gateway value to forget for ``key`` in ``scope`` (what ``scope(request)``
        returned for its requests; None for a middleware without a scope function)."""
        return self.value(self.key_from_header(key) or key, scope)

    async def forget(self, gateway: Gateway, key: str, scope: str | None = None) -> bool:
        """Forget ``key`` (in ``scope``) and its stored response everywhere, as
        :meth:`dedup.Gateway.forget` does a value: True if its row was deleted. The next
        request with the key runs the handler again."""
        value = self.forgotten_value(key, scope)
        forgotten = await gateway.forget(self.kind, value)
        self.cache.drop(value)  # every process's copy goes with the key's tier entry
        return forgotten

    # -------------------------------------------------------------- the claim

    def cached(self, gateway: Gateway, value: str, fingerprint: str | None) -> Response | None:
        """The answer to a request whose key's stored response is in the cache (a replay,
        or a 422), with no network; None when it is not there (then :meth:`claim`).

        Only while the Gateway is open and not degraded: otherwise the request gets what
        :meth:`claim` answers (a 503), as it did before the key was cached."""
        entry = self.cache.entry(value)
        if entry is None or gateway.degraded or gateway._engine is None:
            return None
        if entry.status and fingerprint is not None and self.mode == "replay":
            stored_fp = entry.fp
            if stored_fp is not None and fingerprint != stored_fp:
                return self._answer(_record_of(entry), fingerprint)  # the 422
        answer = entry.answer
        if answer is None:  # the same for every request that matches (a race only rebuilds it)
            answer = entry.answer = self._answer(_record_of(entry), None)
        return answer

    def remember(
        self, gateway: Gateway, value: str, record: _Record, digest: bytes | None = None
    ) -> None:
        """Put ``value``'s record (``digest``: its value digest, if known) in the cache,
        only with the key in the local tier, where a saved key's answer just put it."""
        if self.cache.max_entries == 0:
            return
        try:
            parts = gateway._parts()
            if digest is None:
                digest = validate_value(value, parts.limits)
        except DedupError:  # closed meanwhile: nothing to keep
            return
        local = parts.local
        local_key = local.key(self.kind, digest)
        if local_key in local.entries:
            fp, response = (None, None) if record is None else record
            self.cache.put(value, fp, response, local, local_key)

    async def claim(
        self, gateway: Gateway, value: str, fingerprint: str | None
    ) -> Lease | Response:
        """Claim the key: a :class:`~dedup._engine.once.Lease` when this request is to run the
        handler, else the answer (a replay, 422, the ingest repeat, or an error): from
        the cache when the key's stored response is there (:meth:`cached`)."""
        answer = self.cached(gateway, value, fingerprint)
        if answer is not None:
            return answer
        return await self.claim_uncached(gateway, value, fingerprint)

    async def claim_uncached(
        self, gateway: Gateway, value: str, fingerprint: str | None
    ) -> Lease | Response:
        """:meth:`claim` of a key that :meth:`cached` did not answer."""
        wait_s = None if self.in_flight == "wait" else 0.0
        try:
            claimed = await begin(gateway, self.kind, value, wait_s=wait_s)
        except DedupError as exc:
            return self.error(exc)
        if isinstance(claimed, Lease):
            return claimed
        record = _decode(claimed.payload) if self.mode == "replay" else None
        self.remember(gateway, value, record)
        return self._answer(record, fingerprint)

    def error(self, exc: DedupError) -> Response:
        """The answer to an error of the claim: 400 for a bad key, 409 with Retry-After
        while the key is in flight, 503 with Retry-After when Redis or the database
        cannot serve (degraded mode included: a second run could not be ruled out).

        A 503 says which component failed, never how: the error's text may hold driver
        messages, hosts and ports, which are for the server's log, not for clients."""
        retry = (("Retry-After", self.retry_after),)
        if isinstance(exc, InvalidInput):
            return problem(400, "invalid_key", str(exc))
        if isinstance(exc, WaitTimeout):
            detail = "a request with this idempotency key is still being handled; retry later"
            return problem(409, "in_progress", detail, retry)
        detail = "the idempotency store is unavailable"  # the Gateway closed, say
        if isinstance(exc, Unavailable):
            detail = _UNAVAILABLE.get(exc.component, detail)
        log.warning("answered 503 to a request with an idempotency key: %s", redact(str(exc)))
        return problem(503, "unavailable", f"{detail}; retry later", retry)

    def answer_saved(self, payload: Any, fingerprint: str | None) -> Response:
        """The answer to a request whose key is saved with ``payload``.

        A key saved with no record to replay (no payload, or one without a status: a
        plain ``save`` of this kind) gets a 422, not a made-up 200: there is no first
        response to give back, and running the handler could repeat what that save
        stood for."""
        return self._answer(_decode(payload) if self.mode == "replay" else None, fingerprint)

    def _answer(self, decoded: _Record, fingerprint: str | None) -> Response:
        if self.mode == "ingest":
            return Response(self.duplicate_status, _JSON_TYPE, b'{"duplicate":true}')
        if decoded is None:
            return problem(
                422,
                "key_mismatch",
                "this idempotency key is saved without a response to replay; use a new key",
            )
        stored_fp, first = decoded
        if fingerprint is not None and stored_fp is not None and fingerprint != stored_fp:
            return problem(
                422,
                "key_mismatch",
                "this idempotency key was used with another request (method, path or body)",
            )
        headers: tuple[tuple[str, str], ...] = (*first.headers, (REPLAYED_HEADER, "true"))
        if first.body is None:
            headers = (*headers, (BODY_OMITTED_HEADER, "true"))
        return Response(first.status, headers, first.body)

    # -------------------------------------------------------------- the outcome

    def stores(self, status: int) -> bool:
        """Whether a handler's answer with ``status`` is stored for the key."""
        if self.mode == "ingest":
            return 200 <= status <= 299
        if 400 <= status <= 499:
            return self.store_4xx and status not in NEVER_STORED
        return 200 <= status <= 399

    def kept(self, headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
        """The response headers that are stored: Content-Type, Location, ``replay_headers``
        (as plain ``str``: a framework's header names may be a subclass)."""
        kept = self.replay_headers
        return tuple((str(n), str(v)) for n, v in headers if n.lower() in kept)

    def kept_raw(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
        """:meth:`kept` of headers as bytes (ASGI's), decoded as latin-1: only the kept
        ones are decoded."""
        kept = self.replay_headers
        return tuple(
            (name, bytes(v).decode("latin-1"))
            for n, v in headers
            if (name := bytes(n).decode("latin-1")).lower() in kept
        )

    async def settle(
        self,
        gateway: Gateway,
        lease: Lease,
        status: int | None,
        kept: tuple[tuple[str, str], ...],
        body: bytes | None,
        fingerprint: str | None,
    ) -> None:
        """Store the handler's answer under the lease, or release the lease when the
        answer must not be stored (``status`` None: the handler sent none). ``kept``:
        the response's headers that are stored (:meth:`kept`, :meth:`kept_raw`). Called
        before the response's last bytes go out, so that a client's next request
        finds the key settled."""
        if status is None or not self.stores(status):
            await lease.fail()
            return
        limit = gateway._parts().limits.max_payload_bytes
        payload = orjson.dumps(self._record(status, kept, body, fingerprint))
        if len(payload) > limit and body is not None:
            # The body does not fit the Gateway's payload limit: status and headers only.
            body = None
            payload = orjson.dumps(self._record(status, kept, body, fingerprint))
        try:
            if len(payload) > limit or b"\\u0000" in payload:
                # Headers past the limit, or a NUL jsonb refuses: encode_payload says which.
                encode_payload(orjson.loads(payload), gateway._parts().limits)
            stored = await lease.store(payload.decode())
        except DedupError as exc:
            # The lease is released: the key stays unsaved and a retry runs again.
            await lease.fail()
            log.warning("could not store the response of a request key (a %d): %r", status, exc)
            return
        decoded: _Record = None
        if self.mode == "replay":
            # This record, as a reader of the row decodes it; or the one of a runner that
            # wrote first.
            first = Response(status, kept, body)
            decoded = (fingerprint, first) if stored is None else _decode(orjson.loads(stored))
        self.remember(gateway, lease.value, decoded, lease.digest)

    def _record(
        self,
        status: int,
        headers: tuple[tuple[str, str], ...],
        body: bytes | None,
        fingerprint: str | None,
    ) -> dict[str, Any]:
        if self.mode == "ingest":
            return {"v": _RECORD_VERSION, "status": status}
        return {
            "v": _RECORD_VERSION,
            "fp": fingerprint,
            "status": status,
            "headers": headers,  # pairs, as JSON arrays
            **_encode_body(body),
        }


def _record_of(entry: Entry) -> _Record:
    """The record of a cache entry, as :func:`_decode` gives it."""
    if not entry.status:
        return None
    return entry.fp, Response(entry.status, entry.headers, entry.body)


def _encode_body(body: bytes | None) -> dict[str, Any]:
    """The body in the record: as text when it is UTF-8 without NUL (jsonb refuses NUL),
    which most API bodies are and which keeps the row readable; else as base64."""
    if body is None:
        return {"body": None}
    if b"\x00" not in body:
        try:
            return {"body": body.decode("utf-8")}
        except UnicodeDecodeError:
            pass
    return {"body": base64.b64encode(body).decode("ascii"), "b64": True}


def _decode(payload: Any) -> tuple[str | None, Response] | None:
    """(fingerprint, response) of a stored record. A payload of another shape (a key
    saved by an older middleware) replays its status with no body and no fingerprint
    to compare; one with no status (None: a plain ``save``) is no record: None."""
    if not isinstance(payload, dict) or payload.get("v") != _RECORD_VERSION:
        status = payload.get("status") if isinstance(payload, dict) else None
        if type(status) is not int or not 100 <= status <= 599:
            return None
        return None, Response(status, (), None)
    raw = payload.get("body")
    body: bytes | None
    if raw is None:
        body = None
    elif payload.get("b64"):
        body = base64.b64decode(raw)
    else:
        body = raw.encode("utf-8")
    headers = tuple((str(n), str(v)) for n, v in payload.get("headers", ()))
    return payload.get("fp"), Response(int(payload["status"]), headers, body)


async def call_maybe(fn: Callable[[Any], Any] | None, request: Any) -> Any:
    """``fn(request)``, awaited when it returns an awaitable; None without ``fn``. (The
    async middlewares take sync or async ``key`` and ``scope`` functions.)"""
    if fn is None:
        return None
    found = fn(request)
    if inspect.isawaitable(found):
        found = await found
    return found


def _flag(value: object, name: str) -> bool:
    if type(value) is not bool:
        raise InvalidInput(f"{name} must be True or False", field=name)
    return value


def _whole(value: object, name: str, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidInput(f"{name} must be an int >= {minimum}", field=name)
    return value
