"""Idempotency-Key middleware for aiohttp apps: a retry gets the first response replayed
instead of running the handler again.

::

    gw = Gateway(REDIS_URL, DATABASE_URL)          # opened in a cleanup_ctx
    app = web.Application(middlewares=[dedup.aiohttp.middleware(gw, kind="orders")])

The rules are those of :mod:`dedup._idempotency`, shared with :mod:`dedup.asgi` and
:mod:`dedup.wsgi`. Here the key is stored (or released) before the response is sent.
A handler's ``web.Response`` is stored with its body (up to ``max_response_bytes``);
a ``StreamResponse`` the handler wrote itself is already sent, so only its status
and headers are stored, after it went out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Unpack

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from dedup._engine.once import Lease
from dedup._idempotency import Idempotency, Options, Response, call_maybe
from dedup.errors import InvalidInput
from dedup.gateway import Gateway

__all__ = ["DedupMiddleware", "KeyFunction", "middleware"]

KeyFunction = Callable[[web.Request], "str | Awaitable[str | None] | None"]
"""Maps a request to a string (sync or async; it may read the body), or None."""


def middleware(
    gateway: Gateway,
    *,
    key: KeyFunction | None = None,
    scope: KeyFunction | None = None,
    **options: Unpack[Options],
) -> DedupMiddleware:
    """An aiohttp middleware that runs the handler at most once per idempotency key and
    replays its response to every retry.

    The options are those of :class:`dedup.asgi.DedupMiddleware`: ``gateway`` (open
    by the time requests arrive, with the default sink), ``key(request)`` and
    ``scope(request)`` (sync or async), and the shared options of
    :class:`dedup._idempotency.Idempotency`.
    """
    if not isinstance(gateway, Gateway):
        raise InvalidInput("gateway must be a dedup.Gateway", field="gateway")
    rules = Idempotency(key=key, scope=scope, **options)

    async def key_of(request: web.Request) -> str | None:
        if key is not None:
            found = await call_maybe(key, request)
            return found or None
        return rules.key_from_header(request.headers.get(rules.header))

    async def settle(lease: Lease, response: web.StreamResponse, fingerprint: str | None) -> None:
        body: bytes | None = None
        if isinstance(response, web.Response) and not response.prepared:
            raw = response.body
            if raw is None:
                body = b""
            elif isinstance(raw, bytes | bytearray):
                body = bytes(raw) if len(raw) <= rules.max_response_bytes else None
        headers = ((str(n), str(v)) for n, v in response.headers.items())
        await rules.settle(gateway, lease, response.status, headers, body, fingerprint)

    @web.middleware
    async def dedup_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not rules.guards(request.method):
            return await handler(request)
        value = await key_of(request)
        if value is None:
            refusal = rules.missing_key()
            return await handler(request) if refusal is None else _response(refusal)
        fingerprint = None
        if rules.reads_body:
            refusal = rules.body_too_large(request.content_length or 0)
            if refusal is not None:
                return _response(refusal)
            body = await request.read()  # kept by aiohttp: the handler reads it again
            refusal = rules.body_too_large(len(body))
            if refusal is not None:
                return _response(refusal)
            method, path, query = request.method.upper(), request.path, request.query_string
            fingerprint = rules.fingerprint_of(method, path, query, body)
        try:
            value = rules.value(value, await call_maybe(scope, request))
        except InvalidInput as exc:
            return _response(rules.error(exc))
        claimed = await rules.claim(gateway, value, fingerprint)
        if isinstance(claimed, Response):
            return _response(claimed)
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # a raised answer is an answer too
            await settle(claimed, exc, fingerprint)
            raise
        except BaseException:
            await claimed.fail()
            raise
        await settle(claimed, response, fingerprint)
        return response

    return DedupMiddleware(dedup_middleware, gateway, rules)


class DedupMiddleware:
    """What :func:`middleware` returns: the aiohttp middleware itself (call it as one),
    with :meth:`forget`."""

    __middleware_version__ = 1  # aiohttp: a new-style middleware (what @web.middleware sets)

    def __init__(self, handle: Middleware, gateway: Gateway, rules: Idempotency) -> None:
        self._handle = handle
        self.gateway = gateway
        self.rules = rules

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        return await self._handle(request, handler)

    async def forget(self, key: str, scope: str | None = None) -> bool:
        """Forget idempotency key ``key`` and its stored response in every process (see
        :meth:`dedup.Gateway.forget`): True if its row was deleted. ``scope`` is what the
        ``scope`` function returned for the key's requests (None without one)."""
        return await self.rules.forget(self.gateway, key, scope)


def _response(answer: Response) -> web.Response:
    # aiohttp copies the headers into a CIMultiDict of its own: no copy of ours first.
    return web.Response(status=answer.status, body=answer.body or b"", headers=answer.headers)
