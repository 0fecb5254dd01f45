"""Idempotency-Key middleware for ASGI apps (Starlette, FastAPI): a retry gets the first
response replayed instead of running the handler again.

Pure ASGI, no framework import::

    gw = Gateway(REDIS_URL, DATABASE_URL)          # opened in the app's lifespan
    app.add_middleware(DedupMiddleware, gateway=gw, kind="orders")

The rules (what is stored, the fingerprint, 409/422/400) are those of
:mod:`dedup._idempotency`, shared with :mod:`dedup.aiohttp` and :mod:`dedup.wsgi`;
this module only reads ASGI requests and sends ASGI responses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Unpack

from dedup._engine.once import Lease
from dedup._idempotency import (
    Capture,
    Idempotency,
    Options,
    Response,
    call_maybe,
)
from dedup.errors import InvalidInput
from dedup.gateway import Gateway

__all__ = ["DedupMiddleware", "KeyFunction"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
KeyFunction = Callable[[Scope], "str | Awaitable[str | None] | None"]
"""Maps the ASGI scope to a string (sync or async), or None."""


class DedupMiddleware:
    """ASGI middleware that runs the handler at most once per idempotency key and
    replays its response to every retry.

    - ``gateway``: the :class:`~dedup.Gateway` (open by the time requests arrive; it
      needs the default sink, where the responses are stored).
    - ``key``: instead of the header, a function of the ASGI scope (sync or async)
      returning the key, or None for "no key".
    - ``scope``: a function of the ASGI scope (sync or async) returning the key's
      scope (a tenant, an auth subject), or None: the same key in two scopes is two
      keys.
    - every option of :class:`dedup._idempotency.Idempotency`: ``kind``, ``header``,
      ``mode``, ``fingerprint``, ``methods``, ``require_key``, ``in_flight``,
      ``store_4xx``, ``max_response_bytes``, ``max_request_bytes``,
      ``replay_headers``, ``duplicate_status``, ``retry_after_s``.

    The response is passed through as the handler sends it, one message behind: the
    key is stored (or released) before the last message goes out, so a client's next
    request finds it settled.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        gateway: Gateway,
        key: KeyFunction | None = None,
        scope: KeyFunction | None = None,
        **options: Unpack[Options],
    ) -> None:
        if not isinstance(gateway, Gateway):
            raise InvalidInput("gateway must be a dedup.Gateway", field="gateway")
        self.app = app
        self.gateway = gateway
        self.rules = Idempotency(key=key, scope=scope, **options)
        self._header = self.rules.header.lower().encode("latin-1")

    async def forget(self, key: str, scope: str | None = None) -> bool:
        """Forget idempotency key ``key`` and its stored response in every process (see
        :meth:`dedup.Gateway.forget`): True if its row was deleted. ``scope`` is what the
        ``scope`` function returned for the key's requests (None without one)."""
        return await self.rules.forget(self.gateway, key, scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rules = self.rules
        if scope["type"] != "http" or not rules.guards(scope["method"]):
            await self.app(scope, receive, send)
            return
        key = self._header_key(scope) if rules.key is None else await self._key_of(scope)
        if key is None:
            refusal = rules.missing_key()
            if refusal is None:
                await self.app(scope, receive, send)
            else:
                await _send(send, refusal)
            return
        fingerprint = None
        if rules.reads_body:
            body = await _read_body(scope, receive, rules)
            if body is None:  # the client went away
                return
            if isinstance(body, Response):
                await _send(send, body)
                return
            receive = _Replaying(body, receive)
            query = bytes(scope.get("query_string", b"")).decode("latin-1")
            fingerprint = rules.fingerprint_of(scope["method"].upper(), scope["path"], query, body)
        try:
            tenant = None if rules.scope is None else await call_maybe(rules.scope, scope)
            value = rules.value(key, tenant)
        except InvalidInput as exc:
            await _send(send, rules.error(exc))
            return
        answer = rules.cached(self.gateway, value, fingerprint)  # a replay, with no await
        if answer is not None:
            await _send(send, answer)
            return
        claimed = await rules.claim_uncached(self.gateway, value, fingerprint)
        if isinstance(claimed, Response):
            await _send(send, claimed)
            return
        await self._run(scope, receive, send, claimed, fingerprint)

    async def _key_of(self, scope: Scope) -> str | None:
        found = await call_maybe(self.rules.key, scope)
        return found or None

    def _header_key(self, scope: Scope) -> str | None:
        header = self._header
        size = len(header)
        for name, value in scope.get("headers", ()):
            # Servers send names lowercased (ASGI says they should): compared as they
            # are first, lowercased only when their length matches.
            if name == header or (len(name) == size and bytes(name).lower() == header):
                return self.rules.key_from_header(bytes(value).decode("latin-1"))
        return None

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        lease: Lease,
        fingerprint: str | None,
    ) -> None:
        relay = _Relay(self, send, lease, fingerprint)
        try:
            await self.app(scope, receive, relay)
        except BaseException:
            ending = relay.ending
            if ending is not None:
                # The answer's store and send finish; the app's error is what the server
                # gets (the task's own, if any, is taken so it is not logged as lost).
                await asyncio.wait((ending,))
                if not ending.cancelled():
                    ending.exception()
            elif not relay.settled:
                relay.settled = True
                await lease.fail()
            raise
        if relay.ending is not None:
            await relay.ending
            return
        await relay.settle(complete=False)  # the app returned without finishing its response
        if relay.held is not None:
            await send(relay.held)


class _Relay:
    """The app's ``send`` for a request that runs the handler: its messages go out one
    behind, captured, and the key is stored (or released) before the last one goes out.

    One object per request, where closures would take a function and a cell per
    variable: a new key's request waits on round trips, so what it holds meanwhile
    reaches the garbage collector's older generations."""

    __slots__ = ("capture", "ending", "fingerprint", "held", "lease", "middleware", "send",
                 "settled")  # fmt: skip

    def __init__(
        self, middleware: DedupMiddleware, send: Send, lease: Lease, fingerprint: str | None
    ) -> None:
        self.middleware = middleware
        self.send = send
        self.lease = lease
        self.fingerprint = fingerprint
        self.capture = Capture(middleware.rules.max_response_bytes)
        self.held: Message | None = None
        self.settled = False
        # The last message's store and send, in a task of its own: the app's send returns
        # at once, so that while the key is stored the app's frames are gone rather than
        # held (the middleware waits for the task before it returns to the server).
        self.ending: asyncio.Task[None] | None = None

    async def settle(self, complete: bool) -> None:
        """Store the captured answer (``complete``) or release the key, once."""
        if not self.settled:
            self.settled = True
            await self._settle(complete)

    async def _settle(self, complete: bool) -> None:
        capture = self.capture
        status = capture.status if complete else None
        middleware = self.middleware
        await middleware.rules.settle(
            middleware.gateway, self.lease, status, capture.headers, capture.body,
            self.fingerprint,
        )  # fmt: skip

    async def _end(self, last: Message) -> None:
        await self._settle(complete=True)
        held, self.held = self.held, None
        if held is not None:
            await self.send(held)
        await self.send(last)

    async def __call__(self, message: Message) -> None:
        if self.ending is not None:  # past the last message: in order, after it
            await self.ending
            await self.send(message)
            return
        kind = message["type"]
        capture = self.capture
        if kind == "http.response.start":
            headers = self.middleware.rules.kept_raw(message.get("headers", ()))
            capture.start(int(message["status"]), headers)
        elif kind == "http.response.body":
            capture.add(bytes(message.get("body", b"")))
            if not message.get("more_body", False) and not self.settled:
                self.settled = True
                self.ending = asyncio.get_running_loop().create_task(self._end(message))
                return
        if self.held is not None:
            await self.send(self.held)
        self.held = message


async def _read_body(scope: Scope, receive: Receive, rules: Idempotency) -> bytes | Response | None:
    """The whole request body, 413 past ``max_request_bytes``, None on a disconnect."""
    for name, value in scope.get("headers", ()):
        if bytes(name).lower() == b"content-length" and bytes(value).isdigit():
            refusal = rules.body_too_large(int(value))
            if refusal is not None:
                return refusal
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        refusal = rules.body_too_large(size)
        if refusal is not None:
            return refusal
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class _Replaying:
    """A receive that hands the app the body read already, then the server's messages."""

    __slots__ = ("body", "receive")

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body: bytes | None = body
        self.receive = receive

    async def __call__(self) -> Message:
        body = self.body
        if body is None:
            return await self.receive()
        self.body = None
        return {"type": "http.request", "body": body, "more_body": False}


async def _send(send: Send, response: Response) -> None:
    start = {"type": "http.response.start", "status": response.status}
    headers = [
        (n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in response.wire_headers()
    ]
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": response.body or b""})
