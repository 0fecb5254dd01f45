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
from dedup._idempotency import Capture, Idempotency, Options, RequestInfo, Response
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
            info = RequestInfo(method, _path(environ), environ.get("QUERY_STRING", ""), body)
            fingerprint = rules.fingerprint(info)
        try:
            value = rules.value(key, None if rules.scope is None else rules.scope(environ))
            gw = self.gateway
            claimed = gw._call(rules.claim(gw.gateway, value, fingerprint))
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
            capture.start(int(status.split(" ", 1)[0]), headers)
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
        return _one_behind(result, capture, settle)


def _one_behind(
    result: Iterable[bytes], capture: Capture, settle: Callable[[bool], None]
) -> Iterator[bytes]:
    """The app's body, one chunk behind: the key is settled before the last chunk."""
    held: bytes | None = None
    try:
        for chunk in result:
            if not chunk:
                continue
            capture.add(chunk)
            if held is not None:
                yield held
            held = chunk
        settle(True)
        if held is not None:
            yield held
    except BaseException:  # the app failed, or the server closed us early
        settle(False)
        raise
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()


def _path(environ: WSGIEnvironment) -> str:
    # WSGI carries the path's bytes as latin-1 text; the other middlewares see UTF-8.
    raw = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
    return raw.encode("latin-1").decode("utf-8", "replace")


def _read_body(environ: WSGIEnvironment, rules: Idempotency) -> bytes | Response:
    """The whole request body, or 413 past ``max_request_bytes``."""
    stream = environ["wsgi.input"]
    length = str(environ.get("CONTENT_LENGTH") or "")
    if length.isdigit():
        refusal = rules.body_too_large(int(length))
        if refusal is not None:
            return refusal
        return bytes(stream.read(int(length))) if int(length) else b""
    if environ.get("wsgi.input_terminated"):  # chunked, read to its end (gunicorn)
        body = bytes(stream.read(rules.max_request_bytes + 1))
        return rules.body_too_large(len(body)) or body
    return b""


def _answer(start_response: StartResponse, response: Response) -> list[bytes]:
    start_response(response.status_line(), response.wire_headers())
    return [response.body or b""]
