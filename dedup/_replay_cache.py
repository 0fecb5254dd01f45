"""The idempotency middlewares' replay cache: the stored responses of saved keys, kept in
process so that a replay needs neither Redis nor the database (see :class:`ReplayCache`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dedup._engine.local import SavedCache
    from dedup._idempotency import Response

__all__ = ["ENTRY_OVERHEAD_BYTES", "Entry", "ReplayCache"]

# What a cache entry costs besides its bodies and header strings (the objects around
# them), counted against replay_cache_bytes so that tiny entries are bounded too.
ENTRY_OVERHEAD_BYTES = 400


class Entry:
    """One saved key's stored response: its record's parts as fields, not a (fingerprint,
    Response) pair, as an entry lives for thousands of requests and each object it holds
    is one more for every full pass of the garbage collector. ``status`` 0: a key saved
    without a record to replay. ``answer``: the replay, built once by the middleware."""

    __slots__ = ("answer", "body", "expires_at", "fp", "headers", "local", "local_key", "size",
                 "stamp", "status")  # fmt: skip

    def __init__(
        self,
        fp: str | None,
        status: int,
        headers: tuple[tuple[str, str], ...],
        body: bytes | None,
        local: SavedCache,
        local_key: int,
        expires_at: float,
        size: int,
    ) -> None:
        self.fp = fp
        self.status = status
        self.headers = headers
        self.body = body
        # The replay built once, for every request that gets it (see Idempotency.cached).
        self.answer: Response | None = None
        self.local = local
        self.local_key = local_key
        self.expires_at = expires_at
        self.size = size
        self.stamp = local.stamp()

    def usable(self) -> bool:
        """Whether the tier still answers the key as saved, and has not forgotten it since
        this entry was put (a key forgotten, then saved again, has another response)."""
        local, key = self.local, self.local_key
        return (
            self.expires_at > time.monotonic()
            and key in local.entries
            and local.answering()
            and (self.stamp == local.generation or not local.invalidated_since(key, self.stamp))
        )


class ReplayCache:
    """The stored responses of one middleware's saved keys, kept in process so that a
    replay needs neither Redis nor the database: a bounded LRU (at most ``max_entries``
    entries and ``max_bytes`` bytes of bodies and headers), keyed by the key's Gateway
    value.

    A row's payload never changes once written (the first writer's stays), so an entry is
    the row as every process reads it. Rows can still be deleted; the rules that bound
    what a deleted row costs:

    - an entry is used only while the Gateway's local tier still holds the key as saved
      and has not forgotten it since the entry was put: whatever drops it there
      (:meth:`dedup.Gateway.forget` in any process, :meth:`dedup.Gateway.purge`, eviction,
      a lookup that found the row gone) drops it here too;
    - an entry is used for ``max_age_s`` after it was put, never longer (a hit does not
      extend it); a row deleted by SQL is forgotten within seconds (the tombstones'
      drain), which drops its entry here too.

    Thread-safe: the WSGI middleware looks up from the server's threads and fills from
    the SyncGateway's loop thread. ``hits`` and ``misses`` count lookups.
    """

    __slots__ = ("_entries", "_lock", "hits", "max_age_s", "max_bytes", "max_entries",
                 "misses", "nbytes")  # fmt: skip

    def __init__(self, max_entries: int, max_bytes: int, max_age_s: float) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        """Bytes held now (bodies, header strings and a fixed cost per entry)."""
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, value: str) -> Entry | None:
        """The usable entry of ``value``, or None (counted as a hit or a miss)."""
        with self._lock:
            entry = self._entries.get(value)
            if entry is None:
                self.misses += 1
                return None
            # A read of the tier's dict, not ``in`` on the tier (which reorders it): the
            # WSGI middleware looks up from a thread other than the tier's loop thread.
            if not entry.usable():
                self._drop(value)
                self.misses += 1
                return None
            self._entries.move_to_end(value)
            self.hits += 1
            return entry

    def put(
        self,
        value: str,
        fp: str | None,
        response: Response | None,
        local: SavedCache,
        local_key: int,
    ) -> None:
        """Keep the stored response of ``value`` (fingerprint ``fp``; None: saved without
        one), whose entry in the local tier ``local`` is ``local_key``; evict the least
        recently used entries past the bounds."""
        size = ENTRY_OVERHEAD_BYTES + len(value)
        if response is not None:
            size += len(response.body or b"") + sum(len(n) + len(v) for n, v in response.headers)
        if self.max_entries == 0 or size > self.max_bytes:
            return
        expires_at = time.monotonic() + self.max_age_s
        if response is None:
            entry = Entry(None, 0, (), None, local, local_key, expires_at, size)
        else:
            status, headers, body = response.status, response.headers, response.body
            entry = Entry(fp, status, headers, body, local, local_key, expires_at, size)
        with self._lock:
            self._drop(value)
            self._entries[value] = entry
            self.nbytes += size
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.size

    def drop(self, value: str) -> None:
        """Drop ``value``'s entry, if any."""
        with self._lock:
            self._drop(value)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _drop(self, value: str) -> None:
        old = self._entries.pop(value, None)
        if old is not None:
            self.nbytes -= old.size
