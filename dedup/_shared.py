"""Step 4 across processes: the fleet's winners share one write queue and one writer.

Batching only its own winners, each process sends smaller statements as the fleet
grows (16 processes of 16 callers can never fill a batch past 16 rows). In shared
mode a winner does not write: it pushes its row onto one Redis list per
namespace. One writer, elected with the project's own fenced lease
(:class:`dedup.lock.Lock`, renewed by its watchdog and taken over when its holder
dies or pauses past it), drains the list into large sorted statements, commits the
markers, and publishes each outcome on the claimant's own channel; every process
answers its callers from those notifications.

Nothing is acknowledged before the row is committed: a claimant answers only when
the writer says its row is in the table. Rows lost with a dead writer or a
restarted Redis are never acknowledged: the claimant re-claims when its lease
runs out (its own lease is extended, so nobody else races it) and queues the row
again; the database's unique key makes every repeat harmless.

The mode: ``shared_writes="auto"`` (the default) writes across processes while
more than one gateway of the namespace is alive (a heartbeat set in Redis), and
per process otherwise, where the extra hop only costs; ``"on"`` and ``"off"`` force it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dedup._flights import Flight, FlightTable
from dedup._wait_queue import WaitQueue
from dedup.claims import Claims
from dedup.errors import Unavailable
from dedup.lock import Lock
from dedup.metrics import Stats
from dedup.scripts import Script
from dedup.types import BatchWriter, Row

__all__ = ["SharedWrites"]

log = logging.getLogger("dedup")

HEARTBEAT = """
-- KEYS[1]: the set of live gateways (score: expiry in ms of the server's clock)
-- ARGV[1]: this gateway's id; ARGV[2]: how long its heartbeat counts, in ms
-- Returns: how many gateways are alive, this one included
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return redis.call('ZCARD', KEYS[1])
"""

LEAVE = """
-- KEYS[1]: the set of live gateways; ARGV[1]: this gateway's id
-- Returns: 1 if it was there
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

_HEARTBEAT, _LEAVE = Script(HEARTBEAT), Script(LEAVE)
_HEARTBEAT_S = 1.0
_HEARTBEAT_TTL_MS = 3500
_POP_BLOCK_S = 0.1
_RECHECK_MARGIN_S = 0.05
_IDLE_S = 0.2


class SharedWrites:
    """The shared write queue of one Gateway: its writer candidate, heartbeat and listener.

    ``mode`` is ``"auto"``, ``"on"`` or ``"off"``. ``enqueue`` queues the rows of
    won flights; :attr:`active` says whether claims should use it now.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        mode: str,
        client: Redis,
        namespace: str,
        claims: Claims,
        sink: BatchWriter,
        flights: FlightTable,
        waits: WaitQueue,
        stats: Stats,
        redis_failed: Callable[[BaseException], object],
        usable: Callable[[], bool],
        spawn: Callable[[Awaitable[None]], None],
        batch_rows: int,
        linger_s: float,
        lease_s: float,
        write_timeout_s: float,
    ) -> None:
        self._loop = loop
        self._mode = mode
        self._client = client
        self._claims = claims
        self._sink = sink
        self._flights = flights
        self._waits = waits
        self._stats = stats
        self._redis_failed = redis_failed
        self._usable = usable
        self._spawn = spawn
        self._batch_rows = batch_rows
        # A busy writer with fewer rows than this tops up every ``linger_s``.
        self._fill = max(1, batch_rows // 2)
        self._linger_s = linger_s
        # Two statements overlap: one fills while the other waits for its commit. Like
        # the per-process batcher, an idle writer sends at once and a busy one lingers
        # for a fuller statement, so statements stay few under load and waits short.
        self._statements = asyncio.Semaphore(2)
        self._writing = 0
        self._popping = False
        self._lease_s = lease_s
        self._queue_ttl_ms = max(1000, int(lease_s * 2000))
        self._write_timeout_s = write_timeout_s
        prefix = namespace + ":{w}:"  # one hash tag: every shared key in one slot
        self._queue_key = (prefix + "queue").encode()
        self._fleet_key = (prefix + "fleet").encode()
        self._writer_key = prefix + "writer"
        self._channels = prefix + "done:"
        self.gateway_id = secrets.token_hex(8)
        self._channel = self._channels + self.gateway_id
        self._listening = False
        self._fleet = 1
        self._stopping = False
        self.writer = False
        """True while this gateway holds the writer lease."""

    @property
    def active(self) -> bool:
        """Whether winners should queue their rows (rather than write them here) now."""
        if self._mode == "off" or not self._listening or not self._usable():
            return False
        return self._mode == "on" or self._fleet > 1

    def start(self) -> None:
        """Start listening, beating and standing for writer (tasks of the engine)."""
        if self._mode == "off":
            return
        self._spawn(self._listen())
        self._spawn(self._beat())
        self._spawn(self._stand())

    async def stop(self) -> None:
        """Stop popping, let the statements in flight finish (bounded), leave the fleet;
        the engine then cancels the tasks. A writer that stops mid-statement would leave
        its rows to their claimants, a lease later."""
        self._stopping = True
        if self._mode == "off":
            return
        deadline = self._loop.time() + self._write_timeout_s + 1
        while (self._writing or self._popping) and self._loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        with contextlib.suppress(RedisError, OSError, TimeoutError):  # it expires anyway
            await asyncio.wait_for(_LEAVE(self._client, [self._fleet_key], [self.gateway_id]), 1)

    # ------------------------------------------------------------- claimant side

    async def enqueue(self, won: list[Flight]) -> None:
        """Queue the rows of ``won`` (leases held) for the writer, then wait for its word.

        If no word comes before the lease runs out, each is claimed again (the
        lease is ours, so it is extended) and queued again.
        """
        gw = self.gateway_id
        rows = [
            orjson.dumps([gw, f.key.hex(), f.kind, f.digest.hex(), f.value, f.payload_json])
            for f in won
        ]
        self._stats.redis_round_trips += 1
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.rpush(self._queue_key, *rows)
            # The rows carry values in clear: none outlives its use. A row older than a
            # lease is written by its claimant anyway, so the queue of a fleet that died
            # vanishes two leases after its last push.
            pipe.pexpire(self._queue_key, self._queue_ttl_ms)
            await pipe.execute()
        self._stats.shared_rows_queued += len(rows)
        due = self._loop.time() + self._lease_s + _RECHECK_MARGIN_S
        recheck = self._waits.recheck_at
        for f in won:
            recheck(f, due)

    def _answer(self, message: bytes) -> None:
        """The writer's word on some of our rows: answer their callers."""
        word: dict[str, Any] = orjson.loads(message)
        inflight, resolve = self._flights.inflight, self._flights.resolve
        for source, field in (("write", "i"), ("db", "e")):
            for key_hex in word.get(field, ()):
                f = inflight.get(bytes.fromhex(key_hex))
                if f is not None and not f.done:
                    if source == "write":
                        self._stats.write += 1
                    else:
                        self._stats.db += 1
                    resolve(f, source)  # type: ignore[arg-type]
        failed = [bytes.fromhex(k) for k in word.get("f", ())]
        if failed:
            self._spawn(self._fail(failed, str(word.get("m", "failed"))))

    async def _fail(self, keys: list[bytes], failure: str) -> None:
        """The writer could not write our rows: release the leases, then fail the callers."""
        try:
            await self._claims.abort(keys)
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)
        message = f"the database write {failure}"
        for key in keys:
            f = self._flights.inflight.get(key)
            if f is not None and not f.done:
                self._flights.fail(f, lambda: Unavailable(message, component="database"))

    async def _listen(self) -> None:
        """Receive the writer's words on this gateway's channel; resubscribe after errors."""
        while not self._stopping:
            if not self._usable():  # never touch a Redis the circuit keeps us off
                await asyncio.sleep(_IDLE_S)
                continue
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                self._listening = True
                while self._usable():
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                    if message is not None and message["type"] == "message":
                        self._answer(message["data"])
            except (RedisError, OSError) as exc:
                self._listening = False
                self._redis_failed(exc)
                await asyncio.sleep(0.2)
            finally:
                self._listening = False
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _beat(self) -> None:
        """Count the live gateways of the namespace, once a second."""
        while not self._stopping:
            if not self._usable():
                await asyncio.sleep(_IDLE_S)
                continue
            try:
                fleet, trips = await _HEARTBEAT(
                    self._client, [self._fleet_key], [self.gateway_id, _HEARTBEAT_TTL_MS]
                )
                self._stats.redis_round_trips += trips
                self._fleet = int(fleet)
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
            await asyncio.sleep(_HEARTBEAT_S)

    # ------------------------------------------------------------- writer side

    async def _stand(self) -> None:
        """Stand for writer: take the writer lease when free, write while it is held."""
        lease = Lock(
            self._client,
            self._writer_key,
            timeout=max(1.0, self._lease_s),
            blocking=False,
            watchdog=True,
            release_signal=False,
        )
        while not self._stopping:
            if not self.active:
                await asyncio.sleep(_IDLE_S)
                continue
            try:
                if not await lease.acquire(blocking=False):
                    await asyncio.sleep(self._lease_s / 3)
                    continue
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
                await asyncio.sleep(self._lease_s / 3)
                continue
            self.writer = True
            log.info("shared writes: this gateway writes for the fleet (fence %s)", lease.fence)
            try:
                while not lease.lost.is_set() and not self._stopping and self._usable():
                    await self._statements.acquire()  # a slot, before popping rows for it
                    self._popping = True
                    try:
                        rows = await self._pop()
                    except BaseException:
                        self._statements.release()
                        raise
                    finally:
                        self._popping = False
                    if rows:
                        self._writing += 1  # now, so that stop() waits for it
                        self._spawn(self._write_in_slot(rows))
                    else:
                        self._statements.release()
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
                await asyncio.sleep(0.2)
            finally:
                self.writer = False
                if not lease.lost.is_set():
                    try:
                        await asyncio.wait_for(lease.release(), 1)
                    except Exception:  # the lease expires on its own
                        log.debug("could not release the writer lease", exc_info=True)

    async def _write_in_slot(self, rows: list[bytes]) -> None:
        try:
            await self._write(rows)
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)
        finally:
            self._writing -= 1
            self._statements.release()

    async def _pop(self) -> list[bytes]:
        """One statement's worth of queued rows: wait for some; while another statement
        is in flight, top up every ``linger_s`` until half full or that one ends."""
        got: Any = await self._client.blmpop(
            _POP_BLOCK_S, 1, self._queue_key.decode(), direction="LEFT", count=self._batch_rows
        )
        self._stats.redis_round_trips += 1
        if not got:
            return []
        rows: list[bytes] = list(got[1])
        while self._writing and len(rows) < self._fill:
            # Let the statement fill: the fleet's winners keep arriving meanwhile.
            await asyncio.sleep(self._linger_s)
            more: Any = await self._client.lpop(self._queue_key, self._batch_rows - len(rows))
            self._stats.redis_round_trips += 1
            if more:
                rows.extend(more)
        return rows

    async def _write(self, raw: list[bytes]) -> None:
        """One sorted INSERT of the queued rows, the markers, then each claimant's word."""
        by_key: dict[bytes, tuple[str, Row]] = {}
        for item in raw:
            gw, key_hex, kind, digest_hex, value, payload_json = orjson.loads(item)
            key = bytes.fromhex(key_hex)
            if key not in by_key:  # a row queued twice (re-claimed) is written once
                by_key[key] = (gw, Row(kind, bytes.fromhex(digest_hex), value, payload_json))
        entries = sorted(by_key.items(), key=lambda e: (e[1][1].kind, e[1][1].digest))
        rows = [row for _, (_, row) in entries]
        stats = self._stats
        stats.db_statements += 1
        stats.db_rows_sent += len(rows)
        stats.shared_statements += 1
        words: dict[str, dict[str, Any]] = {}
        try:
            inserted = set(await asyncio.wait_for(self._sink(rows), self._write_timeout_s))
        except Exception as exc:
            stats.db_errors += 1
            failure = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc!r}"
            for key, (gw, _) in entries:
                word = words.setdefault(gw, {"f": []})
                word["f"].append(key.hex())
            for word in words.values():
                word["m"] = failure
            await self._publish(words)
            return
        for key, (gw, row) in entries:
            field = "i" if (row.kind, row.digest) in inserted else "e"
            words.setdefault(gw, {"i": [], "e": []})[field].append(key.hex())
        # Callers are answered once the rows are committed; the markers follow.
        await self._publish(words)
        try:
            await self._claims.commit([key for key, _ in entries])
        except (RedisError, OSError) as exc:
            stats.redis_errors += 1
            self._redis_failed(exc)
            log.warning("could not mark %d saved values in Redis: %s", len(entries), exc)

    async def _publish(self, words: dict[str, dict[str, Any]]) -> None:
        prefix = self._channels
        async with self._client.pipeline(transaction=False) as pipe:
            for gw, word in words.items():
                pipe.publish(prefix + gw, orjson.dumps(word))
            await pipe.execute()
        self._stats.redis_round_trips += 1
