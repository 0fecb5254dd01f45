"""Ingest middleware for ASGI apps (Starlette, FastAPI): drop repeated requests before
the handler runs.

Pure ASGI, no framework import::

    gw = Gateway(REDIS_URL, DATABASE_URL)          # opened in the app's lifespan
    app.add_middleware(DedupMiddleware, gateway=gw, kind="events")

A request's key comes from a header (``Idempotency-Key`` by default) or from
``key(scope)``; a request without a key passes through untouched. The first request
with a key claims it (the lease of :meth:`dedup.Gateway.once`, renewed while the
handler runs) and runs the handler; only a 2xx answer of the handler marks the key
saved, with ``{"status": <code>}`` as its payload. Any other answer, or an exception,
releases the key, so a retry runs the handler again. A repeat of a saved key gets
``repeat_status`` (409 by default) with a JSON body, without calling the handler; a
repeat that arrives while the first is being handled waits for its outcome (at most
the Gateway's ``wait_timeout_s``; then 409 ``in_progress`` with Retry-After).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from dedup import _embed
from dedup.errors import DedupError, InvalidInput
from dedup.gateway import Gateway
from dedup.keys import validate_kind

__all__ = ["DedupMiddleware", "KeyFunction"]

log = logging.getLogger("dedup")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
KeyFunction = Callable[[Scope], "str | Awaitable[str | None] | None"]
"""Maps the ASGI scope to the request's key, or None to let it through untouched."""


class DedupMiddleware:
    """ASGI middleware that runs the handler at most once per request key.

    - ``gateway``: the :class:`~dedup.Gateway` (open by the time requests arrive; it
      needs the default sink).
    - ``kind="request"``: the kind the keys are saved under.
    - ``header="Idempotency-Key"``: the request header holding the key.
    - ``key``: instead of the header, a function of the ASGI scope (sync or async)
      returning the key, or None to let the request through untouched.
    - ``repeat_status=409``: the status of a repeat's response (200 suits clients
      that treat a replay as success).
    - ``repeat_body``: ``f(key, stored_payload)`` -> the repeat's JSON body (default
      ``{"error": "duplicate", "key": ..., "status": <first answer's status>}``).

    Errors answer without calling the handler: 400 for a bad key (longer than the
    Gateway's ``max_value_bytes``, or with NUL), 503 with Retry-After when Redis or
    the database cannot serve (also in degraded mode: without Redis, a second run
    could not be ruled out).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        gateway: Gateway,
        kind: str = "request",
        header: str = "Idempotency-Key",
        key: KeyFunction | None = None,
        repeat_status: int = 409,
        repeat_body: _embed.RepeatBody = _embed.repeat_body,
    ) -> None:
        if not isinstance(gateway, Gateway):
            raise InvalidInput("gateway must be a dedup.Gateway", field="gateway")
        if key is not None and not callable(key):
            raise InvalidInput("key must be a callable on the ASGI scope", field="key")
        if not isinstance(header, str) or not header:
            raise InvalidInput("header must be a header name", field="header")
        self.app = app
        self.gateway = gateway
        self.kind = validate_kind(kind)
        self.repeat_status = _embed.check_status(repeat_status)
        self.repeat_body = repeat_body
        self._header = header.lower().encode("latin-1")
        self._key = key

    async def _key_of(self, scope: Scope) -> str | None:
        if self._key is not None:
            found = self._key(scope)
            if inspect.isawaitable(found):
                found = await found
            return found or None
        for name, value in scope.get("headers", ()):
            if name.lower() == self._header:
                text = bytes(value).decode("latin-1").strip()
                return text or None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = await self._key_of(scope)
        if key is None:
            await self.app(scope, receive, send)
            return
        try:
            claimed = await _embed.begin(self.gateway, self.kind, key)
        except DedupError as exc:
            code, body, headers = _embed.http_error(exc)
            await _answer(send, code, body, headers)
            return
        if isinstance(claimed, _embed.Saved):
            await _answer(send, self.repeat_status, self.repeat_body(key, claimed.payload), {})
            return
        status: int | None = None

        async def send_seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
        except BaseException:
            await claimed.fail()
            raise
        if status is not None and 200 <= status < 300:
            try:
                await claimed.finish({"status": status})
            except DedupError as exc:
                # The answer is sent already; the key stays unsaved, so a retry runs
                # the handler again.
                log.warning("could not mark request key saved after a %d: %r", status, exc)
        else:
            await claimed.fail()


async def _answer(send: Send, status: int, body: Any, headers: dict[str, str]) -> None:
    raw = orjson.dumps(body)
    header_list = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": header_list})
    await send({"type": "http.response.body", "body": raw})
