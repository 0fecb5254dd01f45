"""Forgetting values: their rows, their markers and every gateway's local entries.

A forget of some values of one kind, in order:

1. **hold**: one script call per batch of keys takes each value's lease under a token
   of the forget's own (``F...``) and clears its markers (a compact bucket's field in
   every generation read, or the ``"1"`` key). A value whose lease a save holds (its
   write in flight) is busy: the forget retries it until that write ends, bounded by
   ``wait_timeout_s`` (then :class:`WaitTimeout`, every hold given back). While the
   forget holds a key, claims answer busy and commits leave it alone, so no save can
   answer "saved" from Redis and no marker can come back before the row is gone.
2. **invalidate**: the digests go out on the namespace's invalidation channel
   (:mod:`dedup._engine.invalidation`), and this process's tier drops them at once.
3. **wait** :data:`FORGET_WAIT_S`: every gateway that answers from its tier after that
   has read the invalidation.
4. **delete** the rows, one statement per kind and chunk; with a cutoff (a prune) only
   rows created before it, so a row saved since is never deleted.
5. **release** the holds. A hold lost meanwhile (the forget was paused past its lease,
   renewed every third of it) means a save may have marked the value again: it is
   forgotten again, up to three times.

So a save racing a forget ends with the row and the marker, or with neither: a save
that answers ``created=False`` has its row (it answered before the forget held the
value, or from a tier that had not read the invalidation yet, while the row was still
there), and a save that waited on the forget's hold claims the value afresh afterwards
and writes a new row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from dedup._claims.keys import KeySpace
from dedup._claims.protocol import Claims
from dedup._engine.invalidation import FORGET_WAIT_S, Invalidations
from dedup.errors import CannotForget, DedupError, Unavailable, WaitTimeout
from dedup.store import DefaultSink

__all__ = ["Forgetter"]

audit = logging.getLogger("dedup.audit")
"""Every forget and prune, by kind and digests (never a value)."""

_SCRIPT_KEYS = 1000  # keys per script call: a call holds Redis for well under 10 ms
_DELETE_ROWS = 5000  # digests per DELETE
_AUDIT_DIGESTS = 200  # digests per audit line (about 7 KB)
_FIRST_RETRY_S = 0.01
_MAX_RETRY_S = 0.2
_ATTEMPTS = 3
PRUNE_IN_FLIGHT = 4
"""Batches of a prune forgotten at once: each waits :data:`FORGET_WAIT_S`, so the rate is
about ``PRUNE_IN_FLIGHT * batch_size`` rows a second at most."""


class Forgetter:
    """Forgets values for one open Gateway (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        claims: Claims,
        keys: KeySpace,
        sink: DefaultSink | None,
        invalidations: Invalidations,
        degraded: Callable[[], bool],
        approximate: bool,
        wait_timeout_s: float,
    ) -> None:
        self._loop = loop
        self._claims = claims
        self._keys = keys
        self._sink = sink
        self._invalidations = invalidations
        self._degraded = degraded
        self._approximate = approximate
        self._wait_timeout_s = wait_timeout_s

    def check(self) -> DefaultSink:
        """The sink to delete from; :class:`CannotForget` or :class:`Unavailable` when
        this Gateway cannot forget now."""
        if self._approximate:
            raise CannotForget(
                "approximate mode cannot forget a value: its Bloom filter cannot delete a "
                "member, so the value would stay 'probably saved' without its row"
            )
        if self._sink is None:
            raise CannotForget(
                "forget needs the default sink: dedup cannot delete a custom sink's rows"
            )
        if self._degraded():
            raise Unavailable(
                "Redis is unavailable (degraded mode): a value cannot be forgotten while "
                "the gateways' markers and local tiers cannot be reached",
                component="redis",
            )
        return self._sink

    async def forget(
        self, kind: str, digests: Sequence[bytes], before: Any = None, *, rows: bool = True
    ) -> set[bytes]:
        """Forget ``digests`` of ``kind`` (distinct); the digests whose rows were deleted.
        ``before``: a sink cutoff; only rows created before it are deleted (a prune).
        ``rows=False``: the rows are gone already (tombstones), only the markers and the
        local entries are cleared (a row saved again since stays)."""
        sink = self.check()
        if not digests:
            return set()
        token = "F" + secrets.token_hex(12)
        deleted: set[bytes] = set()
        todo = list(digests)
        for attempt in range(_ATTEMPTS):
            keys = {self._keys.key(kind, d): d for d in todo}
            lost = await self._forget_once(
                sink if rows else None, token, kind, keys, before, deleted
            )
            if not lost:
                break
            todo = [keys[k] for k in lost]
            audit.warning(
                "forget of kind %r lost its hold on %d values (paused past its lease?); "
                "forgetting them again (attempt %d)",
                kind, len(todo), attempt + 2,
            )  # fmt: skip
        else:
            raise DedupError(f"{len(todo)} values could not be held long enough to forget them")
        for i in range(0, len(digests), _AUDIT_DIGESTS):
            chunk = digests[i : i + _AUDIT_DIGESTS]
            if not rows:
                audit.info(
                    "cleared the markers of %d values of kind %r whose rows were deleted "
                    "outside dedup; digests %s",
                    len(chunk),
                    kind,
                    ",".join(d.hex() for d in chunk),
                )
                continue
            audit.info(
                "forgot values of kind %r: %d rows deleted of %d asked%s; digests %s",
                kind,
                sum(1 for d in chunk if d in deleted),
                len(chunk),
                "" if before is None else f" (created before {before})",
                ",".join(d.hex() for d in chunk),
            )
        return deleted

    async def prune(
        self,
        kind: str,
        older_than_s: float,
        *,
        batch_size: int,
        progress: Callable[[int, int], None] | None,
    ) -> int:
        """Forget every row of ``kind`` created more than ``older_than_s`` ago (by the
        database's clock), ``batch_size`` rows a batch, up to :data:`PRUNE_IN_FLIGHT`
        batches at once; returns how many rows were deleted. ``progress(done, total)``
        follows each batch (``total``: the rows older than the cutoff at the start)."""
        sink = self.check()
        before = await sink.cutoff(older_than_s)
        total = await sink.count_older(kind, before)
        audit.info("prune of kind %r: rows created before %s, %d of them", kind, before, total)
        done = 0
        slots = asyncio.Semaphore(PRUNE_IN_FLIGHT)
        tasks: set[asyncio.Task[set[bytes]]] = set()
        failure: list[BaseException] = []

        def finished(task: asyncio.Task[set[bytes]]) -> None:
            nonlocal done
            tasks.discard(task)
            slots.release()
            if task.cancelled():
                return
            exc = task.exception()
            if exc is not None:
                failure.append(exc)
                return
            done += len(task.result())
            if progress is not None:
                progress(done, total)

        after = b""
        try:
            while not failure:
                page = await sink.older_digests(kind, before, after, batch_size)
                if not page:
                    break
                after = page[-1]
                await slots.acquire()
                if failure:
                    slots.release()
                    break
                task = self._loop.create_task(self.forget(kind, page, before))
                tasks.add(task)
                task.add_done_callback(finished)
            if tasks:
                await asyncio.wait(list(tasks))
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.wait(list(tasks))
        if failure:
            raise failure[0]
        audit.info("prune of kind %r: %d rows deleted", kind, done)
        return done

    async def _forget_once(
        self,
        sink: DefaultSink | None,
        token: str,
        kind: str,
        keys: dict[bytes, bytes],
        before: Any,
        deleted: set[bytes],
    ) -> list[bytes]:
        """One pass of the module's steps over ``keys`` (key -> digest): adds the rows it
        deleted to ``deleted`` (no ``sink``: deletes none); returns the keys whose hold
        was lost meanwhile."""
        held: list[bytes] = []
        renewer: asyncio.Task[None] | None = None
        try:
            await self._hold(token, list(keys), held)
            renewer = self._loop.create_task(self._renew(token, held))
            try:
                await self._invalidations.publish(kind, list(keys.values()))
            except (RedisError, OSError) as exc:
                raise Unavailable(f"Redis failed: {exc!r}", component="redis") from None
            await asyncio.sleep(FORGET_WAIT_S)
            if sink is not None:
                await self._delete_rows(sink, kind, list(keys.values()), before, deleted)
            renewer.cancel()
            letters = await self._script(self._claims.forget_release, held, token)
            held = []
            return [k for k, letter in zip(keys, letters, strict=True) if letter != "1"]
        finally:
            if renewer is not None:
                renewer.cancel()
            if held:  # failed or cancelled: give the holds back (markers stay cleared)
                with contextlib.suppress(RedisError, OSError, asyncio.CancelledError):
                    await asyncio.shield(self._script(self._claims.forget_release, held, token))

    async def _delete_rows(
        self,
        sink: DefaultSink,
        kind: str,
        digests: list[bytes],
        before: Any,
        deleted: set[bytes],
    ) -> None:
        """Delete the rows of ``digests`` (a statement per :data:`_DELETE_ROWS`), adding
        those deleted to ``deleted``; the database's failures as :class:`Unavailable`."""
        try:
            for i in range(0, len(digests), _DELETE_ROWS):
                deleted.update(await sink.forget_rows(kind, digests[i : i + _DELETE_ROWS], before))
        except (DedupError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise Unavailable(
                f"the database delete failed: {exc!r}", component="database"
            ) from None

    async def _hold(self, token: str, keys: list[bytes], held: list[bytes]) -> None:
        """Hold every key of ``keys`` (retrying busy ones), appending each to ``held``."""
        deadline = self._loop.time() + self._wait_timeout_s
        pause = _FIRST_RETRY_S
        todo = keys
        while True:
            letters = await self._script(self._claims.forget, todo, token)
            busy: list[bytes] = []
            for key, letter in zip(todo, letters, strict=True):
                (held if letter == "W" else busy).append(key)
            if not busy:
                return
            if self._loop.time() + pause > deadline:
                raise WaitTimeout(
                    f"{len(busy)} values stayed leased by a save for more than "
                    f"{self._wait_timeout_s} s; nothing of this forget was deleted"
                )
            await asyncio.sleep(pause)
            pause = min(_MAX_RETRY_S, pause * 2)
            todo = busy

    async def _renew(self, token: str, held: list[bytes]) -> None:
        """Extend the holds every third of a lease until cancelled."""
        while True:
            await asyncio.sleep(self._claims.lease_ms / 3000)
            with contextlib.suppress(RedisError, OSError):
                await self._script(self._claims.forget, list(held), token)

    async def _script(
        self, call: Callable[[Sequence[bytes], str], Any], keys: Sequence[bytes], token: str
    ) -> str:
        """``call`` over ``keys`` in chunks of :data:`_SCRIPT_KEYS`, all at once; the
        letters in key order. Redis errors become :class:`Unavailable`."""
        try:
            chunks = [keys[i : i + _SCRIPT_KEYS] for i in range(0, len(keys), _SCRIPT_KEYS)]
            parts = await asyncio.gather(*(call(chunk, token) for chunk in chunks))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"Redis failed: {exc!r}", component="redis") from None
        return "".join(parts)
