"""The local tier's invalidations: how every gateway hears that values were forgotten.

A local tier answers "saved" with no network, so a value forgotten elsewhere (its row
deleted, :mod:`dedup._engine.forget`) must leave every gateway's tier before its row
goes. The rule is Redis client-side caching's:

- a forget publishes the values' digests on the namespace's invalidation channel, and
  every gateway that holds the channel drops them from its tier when it reads them;
- a gateway that lost the channel, or never had it, answers nothing from its tier; when
  it holds the channel again it drops its whole tier first (it may have missed some).

"Holds the channel" is proved, not assumed. Every :data:`PING_S` each gateway publishes
a random nonce on a channel of its own, read on the same subscription: Redis delivers a
subscriber's messages in the order it ran the PUBLISHes, so when a gateway reads back
the nonce it sent at time ``t``, it has read every invalidation published before ``t``.
It then lets its tier answer until ``t + WINDOW_S`` (:attr:`SavedCache.until`), checked
on the monotonic clock at each answer. A forget waits :data:`FORGET_WAIT_S` (a little
more than :data:`WINDOW_S`) after its PUBLISH returned before it deletes the rows: a
gateway answering from its tier after that has read back a nonce sent after the
invalidation was published, so it read the invalidation first. Only durations are
compared, each on one machine's clock; clocks need not agree.

A gateway paused, starved of CPU or cut off from Redis for longer than the window
simply stops answering from its tier (its saves go to Redis, or to the database while
Redis is skipped) until it reads a nonce back again. A value invalidated while a claim
or a read that will call it saved is on its way is not added back by that answer
(:meth:`SavedCache.add` with the stamp taken before the request).

The same channel carries the namespace's marker resets (:mod:`dedup._engine.guardian`):
a reset names the new marker epoch; a gateway that hears one of a later epoch than its
own moves its claims to it and drops its whole tier.

Messages are signed with ``shared_secret`` (keyed BLAKE2b) and checked as
:mod:`dedup._engine.shared_wire` checks its own; a forged invalidation could only make
a gateway forget a value locally (a Redis claim more), never call one saved. On a
Redis Cluster every message of the namespace goes through one node (the one serving
the invalidation channel's slot), so that one ordered stream carries them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import NoPermissionError, RedisError

from dedup._claims.keys import derive_key
from dedup._claims.protocol import Claims
from dedup._engine.local import SavedCache
from dedup._engine.shared_wire import BadMessage, sign, signed_body
from dedup._redis.mux import Mux
from dedup._values import DIGEST_BYTES, validate_kind
from dedup.errors import InvalidInput

__all__ = ["FORGET_WAIT_S", "PING_S", "WINDOW_S", "Invalidations"]

log = logging.getLogger("dedup")

WINDOW_S = 1.0
"""How long after sending a nonce it has read back a gateway's tier may answer."""
PING_S = 0.1
"""How often a gateway sends a nonce to itself (a tenth of the window: a slow round
trip or two does not stop its tier)."""
FORGET_WAIT_S = WINDOW_S * 1.01 + 0.02
"""How long a forget waits after publishing before it deletes the rows: the window, a
1 % allowance for clocks that run at different rates, and 20 ms."""

_FORMAT = 1
_TOPIC = "forgotten"
_RESET = "reset"
_CHUNK = 2000  # digests per message (64 KB of hex)
_RETRY_S = 0.2


class Invalidations:
    """The invalidation channel of one Gateway: publishes forgets, applies those it
    hears to its local tier, and proves it hears them (see the module docstring).

    With shared writes the fleet's listener carries these channels on its own
    subscription (:attr:`channels`, :meth:`heard`, :meth:`subscribed`, :meth:`lost`):
    the saved values it learns and the invalidations then come in one ordered stream.
    Otherwise :meth:`start` runs a listener of its own (``own_listener``).
    """

    def __init__(
        self,
        *,
        client: Redis | RedisCluster,
        namespace: str,
        secret: bytes,
        local: SavedCache,
        claims: Claims,
        usable: Callable[[], bool],
        spawn: Callable[[Awaitable[None]], None],
    ) -> None:
        self._client = client
        self._local = local
        self._claims = claims
        self._usable = usable
        self._spawn = spawn
        self.channel = f"{namespace}:{_TOPIC}"
        self._ping_channel = f"{self.channel}:{secrets.token_hex(8)}"
        self.channels = [self.channel, self._ping_channel]
        self._channel_b, self._ping_b = self.channel.encode(), self._ping_channel.encode()
        self._mac_key = derive_key(secret, b"invalidate") if secret else b""
        self._pings: dict[bytes, float] = {}  # nonce -> when it was sent (monotonic)
        self._live = False
        self._stopping = False
        self._wake = asyncio.Event()  # send a nonce now (just subscribed)
        self.bad_messages = 0

    # ------------------------------------------------------------- lifecycle

    def start(self, *, own_listener: bool) -> None:
        """Start sending nonces, and listening unless another listener carries
        :attr:`channels`."""
        self._spawn(self._ping())
        if own_listener:
            self._spawn(self._listen())

    async def ready(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the tier may answer: at open, so that a
        new Gateway answers repeats locally from its first saves. Whether it may."""
        deadline = time.monotonic() + timeout_s
        while not self._local.answering() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.002)  # polled: only at open
        return self._local.answering()

    def stop(self) -> None:
        """Stop (the engine cancels the tasks); the tier stops answering."""
        self._stopping = True
        self.lost()

    # ------------------------------------------------------------- the subscription

    def subscribed(self) -> None:
        """The subscription to :attr:`channels` is confirmed: from now on every message
        is heard. What the tier holds may have missed some, so it starts empty."""
        self._local.reset()
        self._pings.clear()
        self._live = True
        self._wake.set()

    def lost(self) -> None:
        """The subscription is gone: the tier answers nothing, and is dropped."""
        self._live = False
        self._local.until = 0.0
        self._local.reset()
        self._pings.clear()

    def heard(self, channel: bytes, data: bytes) -> bool:
        """Handle a message if it is on one of :attr:`channels` (True), else False.
        Runs in the subscription's read callback, in the order Redis sent them."""
        if channel == self._ping_b:
            sent = self._pings.pop(data, None)
            if sent is not None and self._live:
                local = self._local
                local.until = max(local.until, sent + WINDOW_S)
                # Nonces sent before this one are answered by it (the stream is ordered).
                for nonce in [n for n, t in self._pings.items() if t <= sent]:
                    del self._pings[nonce]
            return True
        if channel == self._channel_b:
            try:
                read = self._read(data)
            except BadMessage as exc:
                self.bad_messages += 1
                log.warning("an invalidation message was ignored: %s", exc)
                return True
            if isinstance(read, int):  # a reset, to this epoch
                self.adopt(read, authoritative=False)
            else:
                self._local.invalidate(*read)
            return True
        return False

    def adopt(self, epoch: int, *, authoritative: bool) -> bool:
        """Move to marker epoch ``epoch`` (from a reset heard, only a later one; from the
        epoch key itself, ``authoritative``, any other one) and drop the whole tier;
        whether it moved."""
        claims = self._claims
        if epoch == claims.epoch or (not authoritative and epoch < claims.epoch):
            return False
        log.info("markers of epoch %d are read from now on (was %d)", epoch, claims.epoch)
        claims.epoch = epoch
        self._local.reset()
        return True

    # ------------------------------------------------------------- publishing

    async def publish(self, kind: str, digests: list[bytes]) -> None:
        """Tell every gateway (this one at once) that these values of ``kind`` are being
        forgotten; returns once Redis has run every PUBLISH. Raises what Redis raises."""
        self._local.invalidate(kind, digests)
        for i in range(0, len(digests), _CHUNK):
            await self._publish(self.channel, self._message(kind, digests[i : i + _CHUNK]))

    async def publish_reset(self, epoch: int) -> None:
        """Tell every gateway (this one at once) that markers of epochs before ``epoch``
        count as absent. Raises what Redis raises."""
        self.adopt(epoch, authoritative=True)
        body = orjson.dumps([_FORMAT, _RESET, epoch])
        await self._publish(self.channel, sign(body, self._mac_key))

    async def _publish(self, channel: str, data: bytes) -> None:
        client = self._client
        if isinstance(client, RedisCluster):
            await client.execute_command("PUBLISH", channel, data, target_nodes=self._node())
        else:
            await client.execute_command("PUBLISH", channel, data)  # type: ignore[no-untyped-call]

    def _node(self) -> ClusterNode:
        """The one node of a cluster through which this namespace's messages go."""
        assert isinstance(self._client, RedisCluster)
        node = self._client.get_node_from_key(self.channel)
        if node is None:
            raise RedisError("no node of the cluster serves the invalidation channel's slot")
        return node

    def _message(self, kind: str, digests: Iterable[bytes]) -> bytes:
        body = orjson.dumps([_FORMAT, _TOPIC, kind, b"".join(digests).hex()])
        return sign(body, self._mac_key)

    def _read(self, raw: object) -> tuple[str, list[bytes]] | int:
        """The kind and digests of an invalidation, or the epoch of a reset;
        :class:`BadMessage` when it cannot be used."""
        body = signed_body(raw, self._mac_key)
        try:
            fields: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise BadMessage("not JSON") from None
        if isinstance(fields, list) and len(fields) == 3 and fields[:2] == [_FORMAT, _RESET]:
            epoch = fields[2]
            if not (isinstance(epoch, int) and 0 <= epoch < 2**63):
                raise BadMessage("malformed epoch")
            return epoch
        if not (isinstance(fields, list) and len(fields) == 4 and fields[:2] == [_FORMAT, _TOPIC]):
            raise BadMessage(f"not an invalidation of format {_FORMAT}")
        kind, hexed = fields[2], fields[3]
        if not isinstance(hexed, str) or len(hexed) % (2 * DIGEST_BYTES):
            raise BadMessage("malformed digests")
        try:
            kind = validate_kind(kind)
            flat = bytes.fromhex(hexed)
        except (InvalidInput, ValueError):
            raise BadMessage("malformed kind or digests") from None
        return kind, [flat[i : i + DIGEST_BYTES] for i in range(0, len(flat), DIGEST_BYTES)]

    # ------------------------------------------------------------- tasks

    async def _ping(self) -> None:
        """Send a nonce to this gateway's own channel every :data:`PING_S`."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PING_S):
                    await self._wake.wait()
            self._wake.clear()
            if not self._live:
                continue
            nonce = secrets.token_hex(8).encode()
            now = time.monotonic()
            pings = self._pings
            for old in [n for n, t in pings.items() if t < now - WINDOW_S]:
                del pings[old]  # never read back: no use any more
            pings[nonce] = now
            # Errors are the claims' business (they open the circuit); a nonce that is
            # not read back only lets the window run out.
            with contextlib.suppress(RedisError, OSError):
                await self._publish(self._ping_channel, nonce)

    async def _listen(self) -> None:
        """Hold a subscription of this gateway's own to :attr:`channels`; subscribe
        again after a failure, while Redis is usable."""
        warned = False
        while not self._stopping:
            if not self._usable():
                await asyncio.sleep(_RETRY_S)
                continue
            try:
                await self._listen_once()
            except NoPermissionError as exc:
                if not warned:  # a setup mistake: say it once, and keep trying
                    warned = True
                    log.warning(
                        "the local tier stays off: the Redis user may not SUBSCRIBE to %s "
                        "(grant +subscribe +publish on &<namespace>:*): %s",
                        self.channel,
                        exc,
                    )
            except (RedisError, OSError) as exc:
                log.debug("the invalidation channel was lost: %r", exc)
            finally:
                self.lost()
            await asyncio.sleep(_RETRY_S)

    async def _listen_once(self) -> None:
        client = self._client
        mux: Mux | None = getattr(getattr(client, "connection_pool", None), "mux", None)
        if mux is not None:
            subscription = await mux.subscribe(self.channels, self._heard_only)
            try:
                self.subscribed()
                while self._usable() and not subscription.lost.done():
                    await asyncio.wait([subscription.lost], timeout=1)
            finally:
                subscription.close()
            return
        if isinstance(client, RedisCluster):
            node = self._node()
            own = Redis(
                connection_pool=ConnectionPool(
                    connection_class=node.connection_class, **node.connection_kwargs
                )
            )
        else:
            own = client
        pubsub = own.pubsub()
        try:
            await pubsub.subscribe(*self.channels)
            confirmed = 0
            while self._usable():
                message = await pubsub.get_message(timeout=1)
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    confirmed += 1
                    if confirmed == len(self.channels):
                        self.subscribed()
                elif message["type"] == "message":
                    self.heard(message["channel"], message["data"])
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            if own is not client:
                await own.aclose()

    def _heard_only(self, channel: bytes, data: bytes) -> None:
        self.heard(channel, data)
