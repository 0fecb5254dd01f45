"""One connection shared by a client's script calls: written as they come, answered in order.

Why: a round trip through a pooled redis-py connection costs about 50 us of the client's
CPU (the pool's checkout and its lock, a timeout scope per read, the parser's stream
reads), a bare asyncio protocol on the same socket about 24 us, most of it the kernel's
(docs/performance.md). The save path and the lock make a round trip per batch, so on a
box whose cores run many gateways that difference is a large part of a request's cost.

:class:`Mux` writes each call's packed commands on one connection as soon as it is made
(pipelining: Redis answers a connection's commands in order) and hands each caller its
replies, parsed by hiredis, from the protocol's ``data_received``. A caller that is
cancelled or times out leaves its replies to be read and dropped, so the stream stays
in step. A call that times out closes the connection (a reply that late means a stalled
server or network, and every call behind it would wait as long): every call in flight
then fails with redis-py's ``TimeoutError``, as on a redis-py connection of its own, and
the next call connects again. A lost connection fails them with ``ConnectionError``.

It serves TCP (plain or TLS, with redis-py's own TLS context from the URL) and
Unix-socket servers, with a password, a user and a database; a pool it cannot serve as
redis-py would (a credential provider, RESP3) keeps redis-py's pooled connections
(:meth:`Mux.for_pool` returns None).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import (
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import (
    ConnectionError,
    InvalidResponse,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup._redis.packing import pack

__all__ = ["BACKOFF_BASE_S", "BACKOFF_CAP_S", "Mux", "Subscription"]

try:
    from redis._parsers.base import BaseParser

    _parse_error: Any = BaseParser.parse_error  # the same exception classes as redis-py's
except ImportError:  # pragma: no cover - a redis-py laid out otherwise
    from redis.exceptions import ResponseError as _parse_error


# Between resends of a call whose connection failed; the pools' Retry (connect.py) backs
# off by the same bounds.
BACKOFF_BASE_S = 0.005
BACKOFF_CAP_S = 0.05


class _Call:
    """One caller's commands in flight: how many replies it waits for, those read."""

    __slots__ = ("count", "future", "replies", "timer")

    def __init__(self, future: asyncio.Future[list[Any]], count: int) -> None:
        self.future = future
        self.count = count
        self.replies: list[Any] = []
        self.timer: asyncio.TimerHandle | None = None


class _Protocol(asyncio.Protocol):
    """The connection's reading side: replies go to the oldest call still waiting."""

    def __init__(self, mux: Mux) -> None:
        self._mux = mux
        self._reader = hiredis.Reader(protocolError=InvalidResponse, replyError=_parse_error)
        # asyncio's or uvloop's (whose transports are not asyncio.Transport instances).
        self.transport: Any = None
        self.calls: deque[_Call] = deque()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Subscribed: every reply is a push, handed to this (no call waits for it).
        self.on_push: Callable[[Any], None] | None = None
        # Why the connection is unusable, once it is (see Mux._broken).
        self.dead: RedisError | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reader, calls = self._reader, self.calls
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except InvalidResponse as exc:  # not RESP: nothing after it can be trusted
                self._mux._broken(self, ConnectionError(f"Redis sent a bad reply: {exc}"))
                return
            if reply is False:  # RESP2 has no boolean: False means "need more bytes"
                return
            if type(reply) is ConnectionError:
                # "max number of clients reached", the one error redis-py reads as this
                # very class (its subclasses, NOAUTH say, leave the connection open): the
                # server closes the connection after it, so it fails every call, not only
                # the one whose command happened to be written before it arrived.
                self._mux._broken(self, ConnectionError(f"Redis sent {reply}"))
                return
            if self.on_push is not None:
                self.on_push(reply)
                continue
            if not calls:  # another reply nobody asked for (an error sent before closing)
                what = str(reply) if isinstance(reply, Exception) else "a reply nobody asked for"
                self._mux._broken(self, ConnectionError(f"Redis sent {what}"))
                return
            call = calls[0]
            call.replies.append(reply)
            if len(call.replies) == call.count:
                calls.popleft()
                if call.timer is not None:
                    call.timer.cancel()
                if not call.future.done():  # else cancelled: its replies are dropped
                    call.future.set_result(call.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._mux._broken(self, ConnectionError("Connection closed by server."))
        if not self.closed.done():
            self.closed.set_result(None)


class Mux:
    """The shared connection of one client (see the module's docstring)."""

    def __init__(
        self,
        kwargs: dict[str, Any],
        unix: bool,
        tls: ssl.SSLContext | None = None,
        resolve: Callable[[], Awaitable[tuple[str, int]]] | None = None,
    ) -> None:
        self._kwargs = kwargs
        self._unix = unix
        self._tls = tls
        # Where the server is, asked before each connect (a Sentinel's primary), if not
        # in the URL; its connection is then dropped on a READONLY answer (a demoted
        # primary), so that the next call asks again.
        self._resolve = resolve
        self._address: tuple[str, int] | None = None
        self._timeout: float | None = kwargs.get("socket_timeout")
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._generation = 0  # disconnects so far
        self._pid = os.getpid()

    @classmethod
    def for_pool(cls, pool: ConnectionPool) -> Mux | None:
        """A Mux for ``pool``'s server, or None when it needs what only redis-py's
        connections do (a credential provider, RESP3, a custom connection class)."""
        kind = pool.connection_class
        kwargs = pool.connection_kwargs
        if not issubclass(kind, (Connection, UnixDomainSocketConnection)):
            return None
        if kwargs.get("credential_provider") is not None or kwargs.get("protocol") in (3, "3"):
            return None
        tls = None
        if issubclass(kind, SSLConnection):
            # The TLS context redis-py would use (CA, client certificate, checks, from
            # the URL's ssl_* options), built once: no I/O until the connect.
            context = getattr(kind(**kwargs), "ssl_context", None)
            made = context.get() if context is not None else None
            if not isinstance(made, ssl.SSLContext):  # a redis-py laid out otherwise
                return None
            tls = made
        resolve = getattr(pool, "get_master_address", None)  # a Sentinel's pool
        return cls(dict(kwargs), issubclass(kind, UnixDomainSocketConnection), tls, resolve)

    async def call(self, packed: bytes, count: int, *, retries: int = 0) -> list[Any]:
        """Send ``packed`` (``count`` RESP commands) and return their replies in order, an
        error reply as its exception object (redis-py's classes).

        A ``ConnectionError`` sends them again on a new connection, up to ``retries``
        times (only for commands safe to run twice), but never once the client was
        disconnected meanwhile: a closed client does not connect again for a call it
        had before it closed."""
        generation = self._generation
        for attempt in itertools.count():
            try:
                replies = await self._call_once(packed, count)
                if self._resolve is not None:
                    self._demoted(replies)
                return replies
            except ConnectionError:
                if attempt >= retries or generation != self._generation:
                    raise
            await asyncio.sleep(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))
        raise AssertionError("unreachable")

    @property
    def address(self) -> tuple[str, int] | None:
        """Where the last connection went, when a resolver named it (else None)."""
        return self._address

    def drop(self) -> None:
        """Close the live connection (calls in flight on it fail with ``ConnectionError``
        and are resent as their retries allow); the next call connects again."""
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None:
            protocol.transport.abort()

    def _demoted(self, replies: list[Any]) -> None:
        """A READONLY answer from the server a Sentinel named: it was demoted (a failover).
        Drop the connection, so that the next call asks the sentinels again; the answer
        itself goes to its caller (degraded mode reads it as ``readonly``)."""
        if any(_readonly(r) for r in replies):
            self.drop()

    async def _call_once(self, packed: bytes, count: int) -> list[Any]:
        if self._pid != os.getpid():  # a forked child: the connection is its parent's
            self._pid, self._protocol, self._connecting = os.getpid(), None, None
        if count < 1:
            raise ValueError("a call sends one command at least")
        protocol = self._protocol
        if protocol is None or protocol.dead is not None:
            protocol = await self._connect()
            if protocol.dead is not None:  # closed by the server right after the connect
                raise protocol.dead
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future(), count)
        protocol.calls.append(call)
        assert protocol.transport is not None
        protocol.transport.write(packed)
        if self._timeout is not None:
            call.timer = loop.call_later(self._timeout, self._timed_out, protocol, call)
        return await call.future

    async def subscribe(
        self, channels: Sequence[str], on_message: Callable[[bytes, bytes], None]
    ) -> Subscription:
        """A connection of its own SUBSCRIBEd to ``channels``, live when this returns:
        each message is handed to ``on_message(channel, data)`` as soon as it is read,
        in the protocol's callback (no task, no queue: it must not block)."""
        protocol = await self._open()
        subscription = Subscription(protocol, len(channels), on_message)
        protocol.on_push = subscription._push
        command = pack(("SUBSCRIBE", *channels))
        assert command is not None
        protocol.transport.write(command)
        try:
            async with asyncio.timeout(self._timeout):
                await asyncio.shield(subscription._confirmed)
        except BaseException:
            subscription.close()
            raise
        return subscription

    async def disconnect(self) -> None:
        """Close the connection (its pool's ``disconnect``); calls in flight fail with
        ``ConnectionError``, and the next call connects again."""
        self._generation += 1  # a connect under way is dropped when it completes
        protocol, self._protocol = self._protocol, None
        if self._pid != os.getpid():  # a forked child: the connection is its parent's
            return
        if protocol is not None and protocol.transport is not None:
            # abort, not close: a close waits for unsent bytes, for ever on a stopped server
            protocol.transport.abort()
            await asyncio.shield(protocol.closed)

    # ------------------------------------------------------------------- internals

    def _timed_out(self, protocol: _Protocol, call: _Call) -> None:
        if not call.future.done():
            call.future.set_exception(RedisTimeoutError(f"Timeout reading from {self._where()}"))
        # The calls behind it wait on the same stalled server: they time out with it
        # (not a ConnectionError, which would send them again, each to wait a whole
        # timeout more).
        self._broken(protocol, RedisTimeoutError(f"Timeout reading from {self._where()}"))

    def _broken(self, protocol: _Protocol, exc: RedisError) -> None:
        """``protocol``'s connection is unusable: fail what waits on it and drop it."""
        if self._protocol is protocol:
            self._protocol = None
        if protocol.dead is None:
            protocol.dead = exc
        calls = protocol.calls
        while calls:
            call = calls.popleft()
            if call.timer is not None:
                call.timer.cancel()
            if not call.future.done():
                call.future.set_exception(exc)
        if protocol.transport is not None:
            protocol.transport.abort()  # even a closing one: its unsent bytes never matter

    async def _connect(self) -> _Protocol:
        """The live connection, made (once, however many callers ask) when there is none."""
        connecting = self._connecting
        if connecting is None or connecting.done():
            connecting = self._connecting = asyncio.ensure_future(self._open_shared())
            # Read by whoever awaits it; if all of them were cancelled, read here.
            connecting.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(connecting)

    async def _open(self) -> _Protocol:
        """A new connection, its handshake done."""
        kwargs, loop = self._kwargs, asyncio.get_running_loop()
        timeout = kwargs.get("socket_connect_timeout") or self._timeout
        try:
            async with asyncio.timeout(timeout):
                if self._unix:
                    _, protocol = await loop.create_unix_connection(
                        lambda: _Protocol(self), kwargs["path"]
                    )
                else:
                    if self._resolve is not None:
                        self._address = await self._resolve()
                    host, port = self._address or (
                        kwargs.get("host", "localhost"),
                        int(kwargs.get("port", 6379)),
                    )
                    _, protocol = await loop.create_connection(
                        lambda: _Protocol(self), host, port, ssl=self._tls
                    )
                    sock = protocol.transport.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    await self._handshake(protocol)
                except BaseException:  # timed out, refused or cancelled: never leave it open
                    protocol.transport.abort()
                    raise
        except TimeoutError:  # asyncio's, the connect's bound
            raise RedisTimeoutError(f"Timeout connecting to {self._where()}") from None
        except OSError as exc:
            raise ConnectionError(f"Error connecting to {self._where()}: {exc}") from None
        return protocol

    async def _open_shared(self) -> _Protocol:
        generation = self._generation
        protocol = await self._open()
        if generation != self._generation:  # disconnected meanwhile: the client is closing
            protocol.transport.abort()
            raise ConnectionError("the Redis client was disconnected while connecting")
        self._protocol = protocol
        return protocol

    async def _handshake(self, protocol: _Protocol) -> None:
        """AUTH, SELECT and CLIENT SETNAME as the URL asks, before any caller's command."""
        kwargs = self._kwargs
        commands: list[tuple[Any, ...]] = []
        password, username = kwargs.get("password"), kwargs.get("username")
        if password is not None:
            user = () if username is None else (username,)
            commands.append(("AUTH", *user, password))
        if kwargs.get("db"):
            commands.append(("SELECT", int(kwargs["db"])))
        if kwargs.get("client_name"):
            commands.append(("CLIENT", "SETNAME", kwargs["client_name"]))
        if not commands:
            return
        packed = b"".join(p for p in (pack(c) for c in commands) if p is not None)
        call = _Call(asyncio.get_running_loop().create_future(), len(commands))
        protocol.calls.append(call)
        assert protocol.transport is not None
        protocol.transport.write(packed)
        for reply in await call.future:
            if isinstance(reply, Exception):
                # A wrong password, say: the server's words name no secret.
                raise ConnectionError(f"Redis refused the connection's setup: {reply}")

    def _where(self) -> str:
        kwargs = self._kwargs
        if self._unix:
            return str(kwargs.get("path"))
        if self._address is not None:
            return f"{self._address[0]}:{self._address[1]}"
        return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


class Subscription:
    """A live SUBSCRIBE of :meth:`Mux.subscribe`: ``lost`` is done once its connection
    has closed (:meth:`close`, or the server or network)."""

    def __init__(
        self, protocol: _Protocol, channels: int, on_message: Callable[[bytes, bytes], None]
    ) -> None:
        self._protocol = protocol
        self._waiting = channels
        self._on_message = on_message
        loop = asyncio.get_running_loop()
        self._confirmed: asyncio.Future[None] = loop.create_future()
        self._confirmed.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.lost: asyncio.Future[None] = loop.create_future()
        protocol.closed.add_done_callback(self._closed)

    def close(self) -> None:
        """Close the connection (at once: nothing is awaited or flushed)."""
        transport = self._protocol.transport
        if transport is not None:
            transport.abort()

    def _push(self, reply: Any) -> None:
        if type(reply) is list and len(reply) == 3:
            kind = reply[0]
            if kind == b"message":
                self._on_message(reply[1], reply[2])
                return
            if kind == b"subscribe":
                self._waiting -= 1
                if self._waiting <= 0 and not self._confirmed.done():
                    self._confirmed.set_result(None)
                return
        if isinstance(reply, Exception):  # SUBSCRIBE refused: NOPERM from an ACL, say
            if not self._confirmed.done():
                # The server's own error (a ResponseError: Redis is up, it says no),
                # not a ConnectionError, which would count against the circuit.
                self._confirmed.set_exception(reply)
            self.close()

    def _closed(self, _: asyncio.Future[None]) -> None:
        if not self._confirmed.done():
            self._confirmed.set_exception(ConnectionError("Connection closed by server."))
        if not self.lost.done():
            self.lost.set_result(None)


def _readonly(reply: Any) -> bool:
    """Whether ``reply`` is a READONLY error (a replica's), also inside a script's error,
    which Redis 6 wraps in ERR."""
    return isinstance(reply, ReadOnlyError) or (
        isinstance(reply, ResponseError) and "READONLY" in str(reply)
    )
