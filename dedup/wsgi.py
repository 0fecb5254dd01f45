"""Idempotency-Key middleware for WSGI apps (Flask, Django, any WSGI app) on a
:class:`~dedup.SyncGateway`: a retry gets the first response replayed instead of
running the view again.

::

    gw = SyncGateway(REDIS_URL, DATABASE_URL)      # one per process, opened at import
    app.wsgi_app = DedupMiddleware(app.wsgi_app, gateway=gw, kind="orders")   # Flask
    application = DedupMiddleware(get_wsgi_application(), gateway=gw)        # Django

The rules are those of :mod:`dedup._idempotency`, shared with :mod:`dedup.asgi` and
:mod:`dedup.aiohttp`. The claim, the store and the release run on the SyncGateway's
loop thread; the app runs in the server's thread as usual. The response is passed
through one chunk behind: the key is stored (or released) before the last chunk
goes out, so a client's next request finds it settled.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Unpack

from dedup._engine.once import Lease
from dedup._idempotency import Capture, Idempotency, Options, Response, problem
from dedup.errors import DedupError, InvalidInput
from dedup.sync import SyncGateway

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["DedupMiddleware", "KeyFunction"]

log = logging.getLogger("dedup")

KeyFunction = Callable[[dict[str, Any]], "str | None"]
"""Maps the WSGI environ to a string, or None."""


class DedupMiddleware:
    """WSGI middleware that runs the app at most once per idempotency key and replays its
    response to every retry.

    - ``app``: the WSGI app (Flask's ``app.wsgi_app``, Django's ``get_wsgi_application()``).
    - ``gateway``: an open :class:`~dedup.SyncGateway` of this process (one per
      worker process: a SyncGateway does not survive ``fork()``, so open it in the
      worker, e.g. in gunicorn's ``post_fork`` or at import without ``--preload``).
    - ``key`` and ``scope``: functions of the WSGI environ, as in
      :class:`dedup.asgi.DedupMiddleware`.
    - every option of :class:`dedup._idempotency.Idempotency`.
    """

    def __init__(
        self,
        app: WSGIApplication,
        *,
        gateway: SyncGateway,
        key: KeyFunction | None = None,
        scope: KeyFunction | None = None,
        **options: Unpack[Options],
    ) -> None:
        if not isinstance(gateway, SyncGateway):
            raise InvalidInput("gateway must be a dedup.SyncGateway", field="gateway")
        self.app = app
        self.gateway = gateway
        self.rules = Idempotency(key=key, scope=scope, **options)
        self._environ_key = "HTTP_" + self.rules.header.upper().replace("-", "_")

    def forget(self, key: str, scope: str | None = None) -> bool:
        """Forget idempotency key ``key`` and its stored response in every process (see
        :meth:`dedup.Gateway.forget`): True if its row was deleted. ``scope`` is what the
        ``scope`` function returned for the key's requests (None without one)."""
        value = self.rules.forgotten_value(key, scope)
        forgotten = self.gateway.forget(self.rules.kind, value)
        self.rules.cache.drop(value)
        return forgotten

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        rules = self.rules
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        if not rules.guards(method):
            return self.app(environ, start_response)
        if rules.key is not None:
            key = rules.key(environ) or None
        else:
            key = rules.key_from_header(environ.get(self._environ_key))
        if key is None:
            refusal = rules.missing_key()
            if refusal is None:
                return self.app(environ, start_response)
            return _answer(start_response, refusal)
        fingerprint = None
        if rules.reads_body:
            body = _read_body(environ, rules)
            if isinstance(body, Response):
                return _answer(start_response, body)
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
            query = environ.get("QUERY_STRING", "")
            fingerprint = rules.fingerprint_of(method, _path(environ), query, body)
        try:
            value = rules.value(key, None if rules.scope is None else rules.scope(environ))
            gw = self.gateway
            # A cached replay is answered here, without a hop to the loop thread.
            cached = rules.cached(gw.gateway, value, fingerprint)
            claimed = cached or gw._call(rules.claim_uncached(gw.gateway, value, fingerprint))
        except DedupError as exc:  # a bad key, or the SyncGateway's own call timeout
            return _answer(start_response, rules.error(exc))
        if isinstance(claimed, Response):
            return _answer(start_response, claimed)
        return self._run(environ, start_response, claimed, fingerprint)

    def _run(
        self,
        environ: WSGIEnvironment,
        start_response: StartResponse,
        lease: Lease,
        fingerprint: str | None,
    ) -> Iterable[bytes]:
        capture = Capture(self.rules.max_response_bytes)
        settled = False

        def settle(complete: bool) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            gw = self.gateway
            status = capture.status if complete else None
            outcome = self.rules.settle(
                gw.gateway, lease, status, capture.headers, capture.body, fingerprint
            )
            try:
                gw._call(outcome)
            except DedupError as exc:  # the lease expires by itself
                log.warning("could not settle a request key: %r", exc)

        def start(
            status: str, headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None
        ) -> Callable[[bytes], object]:
            capture.start(int(status.split(" ", 1)[0]), self.rules.kept(headers))
            write = start_response(status, headers, exc_info)

            def write_captured(data: bytes) -> object:  # PEP 3333's legacy write()
                capture.add(data)
                return write(data)

            return write_captured

        try:
            result = self.app(environ, start)
        except BaseException:
            settle(complete=False)
            raise
        return _OneBehind(result, capture, settle)


class _OneBehind:
    """The app's body, one chunk behind: the key is settled before the last chunk.

    An iterable class rather than a generator for :meth:`close`: a server (or an outer
    middleware) may close the response before asking for its first chunk, and a
    generator's body, hence its cleanup, never runs then; the lease would be left
    held, renewed by its watchdog, and every retry answered 409. Otherwise it behaves
    as the generator it replaces did.
    """

    __slots__ = ("_capture", "_chunks", "_closed", "_held", "_result", "_settle", "_state")

    def __init__(
        self, result: Iterable[bytes], capture: Capture, settle: Callable[[bool], None]
    ) -> None:
        self._result = result
        self._capture = capture
        self._settle = settle
        self._chunks: Iterator[bytes] | None = None
        self._held: bytes | None = None
        # "body": passing the app's chunks; "last": settled, the held chunk still to
        # go; "done": nothing more to give.
        self._state = "body"
        self._closed = False

    def __iter__(self) -> _OneBehind:
        return self

    def __next__(self) -> bytes:
        if self._state == "last":
            self._state = "done"
            held, self._held = self._held, None
            if held is not None:
                return held
        if self._state == "done":
            self._close_result()
            raise StopIteration
        try:
            if self._chunks is None:
                self._chunks = iter(self._result)
            for chunk in self._chunks:
                if not chunk:
                    continue
                self._capture.add(chunk)
                held, self._held = self._held, chunk
                if held is not None:
                    return held
            self._settle(True)
        except BaseException:  # the app (or the settling) failed
            self._state = "done"
            self._settle(False)
            self._close_result()
            raise
        self._state = "last"
        return next(self)

    def close(self) -> None:
        """The server is done with the response (PEP 3333), whether or not it was read to
        its end: a key not settled yet is released (the answer was not sent whole), and
        the app's own response is closed."""
        self._state = "done"
        self._held = None
        try:
            self._settle(False)  # a no-op once the key is settled
        finally:
            self._close_result()

    def __del__(self) -> None:
        # As the generator did when it was collected unclosed (a server that breaks
        # PEP 3333's close() rule): release the key rather than leave it held.
        if not self._closed:
            self.close()

    def _close_result(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self._result, "close", None)
        if close is not None:
            close()


def _path(environ: WSGIEnvironment) -> str:
    # WSGI carries the path's bytes as latin-1 text; the other middlewares see UTF-8.
    raw = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
    return raw.encode("latin-1").decode("utf-8", "replace")


def _read_body(environ: WSGIEnvironment, rules: Idempotency) -> bytes | Response:
    """The whole request body; 413 past ``max_request_bytes``, 400 when it ends before
    its Content-Length (the client went away mid-body)."""
    stream = environ["wsgi.input"]
    length = str(environ.get("CONTENT_LENGTH") or "")
    if length.isdigit():
        expected = int(length)
        refusal = rules.body_too_large(expected)
        if refusal is not None:
            return refusal
        body = bytearray()
        while len(body) < expected:  # a read may return less than asked before the end
            chunk = stream.read(expected - len(body))
            if not chunk:
                break
            body.extend(chunk)
        if len(body) < expected:
            # gunicorn and wsgiref give a short read when the client disconnects. Run
            # with it, the app would see a whole but truncated request, and its answer
            # (a 400, say, stored as 4xx answers are) would be the key's for ever: the
            # client's retry with the full body would get 422. So the key is not
            # claimed and the app not called.
            return problem(
                400,
                "incomplete_body",
                f"the request body ended after {len(body)} of the {expected} bytes "
                "of its Content-Length",
            )
        return bytes(body)
    if environ.get("wsgi.input_terminated"):  # chunked, read to its end (gunicorn)
        whole = bytes(stream.read(rules.max_request_bytes + 1))
        return rules.body_too_large(len(whole)) or whole
    return b""


def _answer(start_response: StartResponse, response: Response) -> list[bytes]:
    start_response(response.status_line(), response.wire_headers())
    return [response.body or b""]
