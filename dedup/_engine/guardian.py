"""The database as the source of truth: markers follow rows that the database lost.

A marker says "saved" for as long as it lives; the contract says a ``created=False``
answer has its row. The database can lose rows without dedup deleting them, in three
ordinary ways, and each gateway's guardian (a task, every :data:`GUARD_S`) notices
each of them:

- **rows deleted by SQL** (a cleanup job, a GDPR script, ``TRUNCATE``): the migrations'
  triggers write each deleted row's key to ``dedup_tombstones``. One gateway at a time
  (the holder of a short Redis lease) drains it: the values are forgotten as
  :mod:`dedup._engine.forget` forgets them (markers cleared under a hold, every local
  tier invalidated, one :data:`~dedup._engine.invalidation.FORGET_WAIT_S` wait), except
  that no row is deleted; then the tombstones go. A ``TRUNCATE`` resets every marker.
- **a database that went back in time** (a restore, a point-in-time recovery, a
  promoted standby that missed the tail of asynchronous replication, a data folder
  put back): every gateway reads, each :data:`GUARD_S`, what the namespace saw of the
  database (its identity: system identifier and timeline, which a restore, a recovery
  or a promotion changes; and the highest WAL position seen), then the database's own.
  A position only grows, so one behind what was seen before it was read, or another
  identity, means commits were lost: one script call (:data:`OBSERVE`) moves the
  namespace to a new marker epoch, once however many gateways notice.
- **on demand**: :meth:`Guardian.reconcile` (``dedup reconcile``), for what the above
  cannot see: a SQLite file put back, or a database loaded from a dump whose position
  happens to be ahead.

A reset is O(1): markers live in buckets whose names carry the namespace's epoch
(:attr:`dedup._claims.protocol.Claims.epoch`), so once the epoch key is incremented
every older marker counts as absent. The new epoch is published on the invalidation
channel (every gateway that hears it moves to it and drops its local tier), and each
guardian also reads the epoch key every :data:`GUARD_S`, which brings a gateway that
missed the message along. The old epoch's buckets, and markers of the ``keys`` layout
(the lease key itself holding ``"1"``, which no epoch renames), are then deleted by a
SCAN of the namespace. After a reset each value's next save goes to the database, once,
and the unique key decides, as after Redis restarted empty. A reset may come twice for
one loss (a drainer whose round outlasted its lease, on a starved machine): the second
costs the fleet one more round of markers written again, nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from dedup._claims.protocol import Claims
from dedup._engine.forget import Forgetter
from dedup._engine.invalidation import FORGET_WAIT_S, Invalidations
from dedup.errors import DedupError, Unavailable
from dedup.metrics import Stats
from dedup.store import DefaultSink
from dedup.types import Reconciled

__all__ = ["GUARD_S", "OBSERVE", "Guardian", "state_key"]

log = logging.getLogger("dedup")
audit = logging.getLogger("dedup.audit")

_T = TypeVar("_T")

GUARD_S = 1.0
"""How often each gateway reads the epoch and the database's position, and the drainer
drains tombstones."""
_DRAIN_LEASE_MS = 10_000  # the drainer's lease, renewed every round: longer than a slow round
_PAGE = 10_000  # tombstones a drain takes at once
_SWEEP_COUNT = 1000  # keys per SCAN step of the sweep

OBSERVE = """
-- Record the database's position; reset the markers if the caller found commits lost.
-- KEYS[1]: the hash of what was seen (fields id, lsn)   KEYS[2]: the marker epoch
-- ARGV[1]: the database's identity now ("<system id>/<timeline>")
-- ARGV[2]: its WAL position now, 16 hex digits (compared as text)
-- ARGV[3]: "1" when the caller found commits lost (against what it read before)
-- ARGV[4]: the epoch the caller read then: only that epoch is incremented, so that
--          gateways noticing the same loss reset once
-- Returns {epoch now, 1 if this call reset the markers else 0}.
local epoch = redis.call('GET', KEYS[2]) or '0'
local reset = 0
if ARGV[3] == '1' and epoch == ARGV[4] then
  epoch = tostring(redis.call('INCR', KEYS[2]))
  reset = 1
end
local seen = redis.call('HMGET', KEYS[1], 'id', 'lsn')
if reset == 1 or seen[1] ~= ARGV[1] or not seen[2] or ARGV[2] > seen[2] then
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'lsn', ARGV[2])
end
return {epoch, reset}
"""

_HOLD = """
-- Hold or renew the drainer's lease.
-- KEYS[1]: the lease   ARGV[1]: this gateway's token   ARGV[2]: the lease in ms
-- Returns 1 when this gateway holds it now, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
"""

_DROP_SAVED = """
-- Delete the keys that hold the old-layout saved marker "1" (a lease is left alone).
-- KEYS: lease-shaped keys   Returns how many were deleted.
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == '1' then
    redis.call('DEL', key)
    n = n + 1
  end
end
return n
"""


async def _database(call: Awaitable[_T]) -> _T:
    """``call``'s result; a failure of the database as :class:`Unavailable` (a round
    that fails is tried again a second later, and logged at debug level only)."""
    try:
        return await call
    except (DedupError, asyncio.CancelledError):
        raise
    except Exception as exc:
        raise Unavailable(f"the database failed: {exc!r}", component="database") from None


def state_key(namespace: str, name: str) -> str:
    """The Redis key of the namespace's ``name`` (``epoch``, ``database``: what it saw of
    the database, ``drainer``): one hash tag, so that they share a Cluster slot."""
    return f"{namespace}:{{dedup-state}}:{name}"


class Guardian:
    """Keeps one open Gateway's markers true to the database (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        client: Redis | RedisCluster,
        namespace: str,
        claims: Claims,
        sink: DefaultSink | None,
        forgetter: Forgetter,
        invalidations: Invalidations,
        stats: Stats,
        usable: Callable[[], bool],
        spawn: Callable[[Awaitable[None]], None],
    ) -> None:
        self._loop = loop
        self._client = client
        self._prefix = namespace.encode() + b":"
        self.epoch_key = state_key(namespace, "epoch")
        self._seen_key = state_key(namespace, "database")
        self._drainer_key = state_key(namespace, "drainer")
        self._claims = claims
        self._sink = sink
        self._forgetter = forgetter
        self._invalidations = invalidations
        self._stats = stats
        self._usable = usable
        self._spawn = spawn
        self._token = secrets.token_hex(12)
        self._observe = client.register_script(OBSERVE)
        self._hold = client.register_script(_HOLD)
        self._drop_saved = client.register_script(_DROP_SAVED)
        self._sweeping = False

    def start(self) -> None:
        """Run the guardian's rounds until the engine stops."""
        self._spawn(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(GUARD_S)
            if not self._usable():  # Redis skipped: nothing to keep true
                continue
            try:
                await self.round()
            except (RedisError, OSError, DedupError) as exc:
                log.debug("the guardian's round failed (tried again in %s s): %r", GUARD_S, exc)
            except Exception:  # a bug: say it, and keep guarding
                log.exception("the guardian's round failed")

    async def round(self) -> None:
        """Follow the epoch, compare the database's position, drain tombstones (the
        database's failures raised as :class:`Unavailable`)."""
        await self.follow_epoch()
        await self.watch_database()
        if self._sink is not None and int(
            await self._hold(keys=[self._drainer_key], args=[self._token, _DRAIN_LEASE_MS])
        ):
            await self.drain(pages=1)

    async def follow_epoch(self) -> None:
        """Read the namespace's epoch key and move to it (a Redis restarted empty has
        none: this gateway's epoch is written back, so that the fleet agrees again)."""
        raw = await self._client.get(self.epoch_key)
        if raw is None:
            await self._client.set(self.epoch_key, self._claims.epoch, nx=True)
            raw = await self._client.get(self.epoch_key)
        if raw is not None:
            self._invalidations.adopt(int(raw), authoritative=True)

    async def watch_database(self) -> None:
        """Compare the database's position with what the namespace saw before it was
        read; reset every marker when commits were lost (:data:`OBSERVE`)."""
        if self._sink is None:
            return
        client = self._client
        seen_id, seen_lsn = (
            None if v is None else v.decode() if isinstance(v, bytes) else str(v)
            for v in await client.hmget(self._seen_key, ["id", "lsn"])
        )
        read_epoch = await client.get(self.epoch_key)
        position = await _database(self._sink.position())  # after: only ahead of those
        if position is None:
            return
        identity, lsn = position
        at = f"{lsn:016x}"
        why = ""
        if seen_id is not None and seen_id != identity:
            why = (
                "it is another database, or on another timeline (a restore, a "
                "point-in-time recovery or a failover)"
            )
        elif seen_lsn is not None and at < seen_lsn:
            why = "its WAL position is behind one seen before (it was put back in time)"
        raw_epoch, reset = await self._observe(
            keys=[self._seen_key, self.epoch_key],
            args=[identity, at, "1" if why else "0", read_epoch or b"0"],
        )
        epoch = int(raw_epoch)
        if not int(reset):
            if why:  # another gateway reset for the same loss: move now, not in a round
                self._invalidations.adopt(epoch, authoritative=True)
            return
        what = why
        log.error(
            "THE DATABASE LOST WRITES that dedup may have acknowledged: %s. Every marker of the "
            "namespace is reset (epoch %d): each value's next save goes to the database "
            "once, and rows that were lost are written again then.",
            what,
            epoch,
        )
        self._stats.marker_resets += 1
        await self._invalidations.publish_reset(epoch)
        self._sweep_soon()

    async def drain(self, *, pages: int | None = None) -> int:
        """Drain the tombstones (``pages`` pages of :data:`_PAGE` at most; None: all);
        how many were drained."""
        sink = self._sink
        if sink is None:
            return 0
        drained = 0
        while pages is None or pages > 0:
            page = await _database(sink.tombstones(_PAGE))
            if not page:
                break
            if any(kind is None for _, kind, _ in page):
                await self.reset("the table was truncated")
            by_kind: dict[str, set[bytes]] = {}
            for _, kind, digest in page:
                if kind is not None and digest is not None:
                    by_kind.setdefault(kind, set()).add(digest)
            await asyncio.gather(
                *(
                    self._forgetter.forget(kind, sorted(digests), rows=False)
                    for kind, digests in by_kind.items()
                )
            )
            await _database(sink.drop_tombstones([tid for tid, _, _ in page]))
            drained += len(page)
            self._stats.tombstones_drained += len(page)
            if pages is not None:
                pages -= 1
            if len(page) < _PAGE:
                break
        return drained

    async def reset(self, why: str) -> int:
        """Move the namespace to a new marker epoch and tell every gateway; the epoch."""
        epoch = int(await self._client.incr(self.epoch_key))
        audit.warning("every marker of the namespace reset (epoch %d): %s", epoch, why)
        self._stats.marker_resets += 1
        await self._invalidations.publish_reset(epoch)
        return epoch

    async def reconcile(self) -> Reconciled:
        """Drain every tombstone, reset every marker, wait until every gateway moved to
        the new epoch (or answers nothing from its local tier), then delete the old
        markers. Safe while the fleet saves."""
        drained = await self.drain()
        epoch = await self.reset("reconcile")
        # A gateway that heard the reset moved at once; one that missed it reads the
        # epoch key within GUARD_S; a tier that could not hear it stopped answering.
        await asyncio.sleep(FORGET_WAIT_S + GUARD_S)
        swept = await self.sweep()
        return Reconciled(epoch=epoch, tombstones=drained, swept=swept)

    def _sweep_soon(self) -> None:
        if not self._sweeping:
            self._sweeping = True
            self._spawn(self._sweep_later())

    async def _sweep_later(self) -> None:
        try:
            await asyncio.sleep(FORGET_WAIT_S + GUARD_S)
            await self.sweep()
        except (RedisError, OSError) as exc:
            log.warning("deleting the markers of earlier epochs failed: %r", exc)
        finally:
            self._sweeping = False

    async def sweep(self) -> int:
        """Delete the namespace's markers of earlier epochs: buckets whose name carries
        another epoch, and lease keys that hold the old-layout "1"; how many keys."""
        current = self._claims.epoch
        bucket = re.compile(rb"(?:\{[^}]*\})?[mb](?:e(\d+)_)?\d*:\d+")
        client = self._client
        nodes: list[Any] = [None]
        if isinstance(client, RedisCluster):
            await client.initialize()
            nodes = list(client.get_primaries())
        removed = 0
        for node in nodes:
            kwargs: dict[str, Any] = {} if node is None else {"target_nodes": node}
            old: list[bytes] = []
            saved: list[bytes] = []
            async for key in client.scan_iter(
                match=self._prefix + b"*", count=_SWEEP_COUNT, **kwargs
            ):
                tail = key[len(self._prefix) :]
                found = bucket.fullmatch(tail)
                if found is not None:
                    if int(found.group(1) or 0) != current:
                        old.append(key)
                elif len(tail[tail.find(b"}") + 1 :] if tail[:1] == b"{" else tail) == 24:
                    saved.append(key)  # lease-shaped: a lease, or an old-layout "1"
                if len(old) >= _SWEEP_COUNT:
                    removed += await client.unlink(*old)
                    old.clear()
                if len(saved) >= 100:
                    removed += await self._drop_saved_keys(saved)
                    saved.clear()
            if old:
                removed += await client.unlink(*old)
            if saved:
                removed += await self._drop_saved_keys(saved)
        return removed

    async def _drop_saved_keys(self, keys: list[bytes]) -> int:
        if isinstance(self._client, RedisCluster):  # one slot a call
            n = 0
            for key in keys:
                n += int(await self._drop_saved(keys=[key]))
            return n
        return int(await self._drop_saved(keys=keys))
