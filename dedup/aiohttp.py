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
from aiohttp.typedefs import Handler

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
    return DedupMiddleware(gateway, Idempotency(key=key, scope=scope, **options))


class DedupMiddleware:
    """What :func:`middleware` returns: the aiohttp middleware itself (call it as one),
    with :meth:`forget`.

    The middleware is this object's ``__call__``, not a function it wraps: each layer
    is one more coroutine per request, which a replay pays for as much as a handler's
    own work."""

    __middleware_version__ = 1  # aiohttp: a new-style middleware (what @web.middleware sets)

    def __init__(self, gateway: Gateway, rules: Idempotency) -> None:
        self.gateway = gateway
        self.rules = rules

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        rules = self.rules
        if not rules.guards(request.method):
            return await handler(request)
        if rules.key is None:
            value = rules.key_from_header(request.headers.get(rules.header))
        else:
            value = await call_maybe(rules.key, request) or None
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
            tenant = None if rules.scope is None else await call_maybe(rules.scope, request)
            value = rules.value(value, tenant)
        except InvalidInput as exc:
            return _response(rules.error(exc))
        answer = rules.cached(self.gateway, value, fingerprint)  # a replay, with no await
        if answer is not None:
            return _response(answer)
        claimed = await rules.claim_uncached(self.gateway, value, fingerprint)
        if isinstance(claimed, Response):
            return _response(claimed)
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # a raised answer is an answer too
            await self._settle(claimed, exc, fingerprint)
            raise
        except BaseException:
            await claimed.fail()
            raise
        await self._settle(claimed, response, fingerprint)
        return response

    async def _settle(
        self, lease: Lease, response: web.StreamResponse, fingerprint: str | None
    ) -> None:
        rules = self.rules
        body: bytes | None = None
        if isinstance(response, web.Response) and not response.prepared:
            raw = response.body
            if raw is None:
                body = b""
            elif isinstance(raw, bytes | bytearray):
                body = bytes(raw) if len(raw) <= rules.max_response_bytes else None
        kept = rules.kept(response.headers.items())
        await rules.settle(self.gateway, lease, response.status, kept, body, fingerprint)

    async def forget(self, key: str, scope: str | None = None) -> bool:
        """Forget idempotency key ``key`` and its stored response in every process (see
        :meth:`dedup.Gateway.forget`): True if its row was deleted. ``scope`` is what the
        ``scope`` function returned for the key's requests (None without one)."""
        return await self.rules.forget(self.gateway, key, scope)


def _response(answer: Response) -> web.Response:
    # aiohttp copies the headers into a CIMultiDict of its own: no copy of ours first.
    return web.Response(status=answer.status, body=answer.body or b"", headers=answer.headers)
