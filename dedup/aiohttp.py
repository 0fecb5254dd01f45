"""Ingest middleware for aiohttp apps: drop repeated requests before the handler runs.

::

    gw = Gateway(REDIS_URL, DATABASE_URL)          # opened in a cleanup_ctx
    app = web.Application(middlewares=[dedup.aiohttp.middleware(gw, kind="events")])

The same rules as :mod:`dedup.asgi`: the key comes from a header
(``Idempotency-Key`` by default) or from ``key(request)`` (sync or async: it may
read the body, which aiohttp keeps for the handler); a request without a key passes
through untouched; only a 2xx answer of the handler marks the key saved; a repeat
gets ``repeat_status`` (409 by default) with a JSON body without calling the handler;
concurrent repeats wait, bounded by the Gateway's ``wait_timeout_s``. Here the key is
marked saved before the response is sent.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from dedup import _embed
from dedup.errors import DedupError, InvalidInput
from dedup.gateway import Gateway
from dedup.keys import validate_kind

__all__ = ["KeyFunction", "middleware"]

log = logging.getLogger("dedup")

KeyFunction = Callable[[web.Request], "str | Awaitable[str | None] | None"]
"""Maps a request to its key, or None to let it through untouched."""


def middleware(
    gateway: Gateway,
    *,
    kind: str = "request",
    header: str = "Idempotency-Key",
    key: KeyFunction | None = None,
    repeat_status: int = 409,
    repeat_body: _embed.RepeatBody = _embed.repeat_body,
) -> Middleware:
    """An aiohttp middleware that runs the handler at most once per request key.

    The options are those of :class:`dedup.asgi.DedupMiddleware`: ``gateway`` (open
    by the time requests arrive, with the default sink), ``kind``, ``header``,
    ``key``, ``repeat_status`` and ``repeat_body(key, stored_payload)``. A bad key
    answers 400, Redis or the database unable to serve 503 with Retry-After, a wait
    for a concurrent request past ``wait_timeout_s`` 409 ``in_progress``.
    """
    if not isinstance(gateway, Gateway):
        raise InvalidInput("gateway must be a dedup.Gateway", field="gateway")
    if key is not None and not callable(key):
        raise InvalidInput("key must be a callable on the request", field="key")
    if not isinstance(header, str) or not header:
        raise InvalidInput("header must be a header name", field="header")
    kind = validate_kind(kind)
    status_of_repeat = _embed.check_status(repeat_status)

    async def key_of(request: web.Request) -> str | None:
        if key is not None:
            found = key(request)
            if inspect.isawaitable(found):
                found = await found
            return found or None
        return request.headers.get(header, "").strip() or None

    async def finish(claimed: _embed.Lease, status: int) -> None:
        if 200 <= status < 300:
            try:
                await claimed.finish({"status": status})
            except DedupError as exc:
                log.warning("could not mark request key saved after a %d: %r", status, exc)
        else:
            await claimed.fail()

    @web.middleware
    async def dedup_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        value = await key_of(request)
        if value is None:
            return await handler(request)
        try:
            claimed = await _embed.begin(gateway, kind, value)
        except DedupError as exc:
            status, body, headers = _embed.http_error(exc)
            return web.json_response(body, status=status, headers=headers)
        if isinstance(claimed, _embed.Saved):
            return web.json_response(repeat_body(value, claimed.payload), status=status_of_repeat)
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # a raised answer is an answer too
            await finish(claimed, exc.status)
            raise
        except BaseException:
            await claimed.fail()
            raise
        await finish(claimed, response.status)
        return response

    result: Middleware = dedup_middleware
    return result
