"""The in-process tier: an LRU of values known saved.

"Saved" is monotonic (a committed row stays committed), so a hit needs no
network and never goes stale. Only committed values enter; nothing in progress.

Memory is the point of this module's shape: a cache of 100,000 entries sits in
every gateway process. An entry is

- a 128-bit ``int`` (44 bytes; 48 as allocated): the value's 16-byte digest XOR a
  128-bit digest of its kind, instead of the ~30-byte Redis key (63 bytes as an
  object; 64 allocated);
- in a plain ``dict`` whose insertion order is the recency order (a hit moves its
  key to the end by deleting and re-inserting it), instead of an ``OrderedDict``,
  which adds a 32-byte linked-list node and an 8-byte slot per table entry.

Two (kind, value) pairs share an entry only if ``D(v1) ^ D(v2) == K(k1) ^ K(k2)``
with D and K BLAKE2b-128: for one kind that is a collision of the value digest,
which the database key ``(kind, digest)`` already relies on never happening;
across kinds it is a 128-bit target, no easier to hit.

Eviction takes the least recently used keys from the front of the dict. Keys
deleted there leave holes that the next scan from the front must step over until
the dict compacts itself, so evicting one key at a time would cost a scan over
all the holes each time; evicting the ``maxsize // 64`` least recently used at
once (one for small caches) makes that scan cheap per key. The cache never holds
more than ``maxsize`` entries.

In front of it, the values most lately answered from it are also kept by their text
(``fronts``, per kind): a repeat found there costs one dict lookup of a string, whose
hash Python keeps, instead of UTF-8 encoding, BLAKE2b and a lookup of a 128-bit key
(0.17-0.18 µs a save against 1.06 µs, ``bench/local_hit_cost.py``). Only values of up
to 128 characters enter it, at most 8,192 of them in all (not more than ``maxsize``): its
dict is about 200 KB, plus the strings it keeps alive (about 0.6 MB more for
26-character values); full, it is emptied and refills from the next repeats. Like the
tier, it holds only values known saved, which stay saved. A repeat found there never
reaches the tier, whose recency order would then let a hot value age out under the
values it takes in (at 8 processes, 137,000 of the fleet's saved values into 100,000
entries: such a value, once the fronts were emptied, went to Redis again as a first
sighting, ~600 claims per process and run); so before the fronts are emptied, their
values' entries are made the most recently used in the tier again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from hashlib import blake2b
from itertools import islice

__all__ = ["SavedCache", "kind_salt"]

_KIND_SALT_BYTES = 16
_MAX_SALTS = 65_536  # memo of kinds' salts; clearing it loses nothing
_EVICT_FRACTION = 64
_FRONT_ENTRIES = 8192  # values kept by their text, all kinds together
_FRONT_MAX_CHARS = 128  # longer values are found by their digest only (bounds its memory)
_RECENT_MAX = 65_536  # invalidated entries remembered, to refuse what a late answer adds


def kind_salt(kind: str) -> int:
    """The 128-bit number a kind's entries are XORed with (BLAKE2b of the kind, personalised)."""
    h = blake2b(kind.encode("utf-8", "surrogatepass"), digest_size=_KIND_SALT_BYTES)
    h.update(b"\x00dedup-local-kind")
    return int.from_bytes(h.digest(), "little")


class SavedCache:
    """A bounded LRU set of (kind, value digest) pairs whose rows are known committed.

    ``maxsize == 0`` disables the tier.
    """

    __slots__ = ("_chunk", "_entries", "_floor", "_front_left", "_front_size", "_fronts",
                 "_recent", "_salts", "generation", "maxsize", "until")  # fmt: skip

    def __init__(self, maxsize: int) -> None:
        if maxsize < 0:
            raise ValueError("local_cache_size must be >= 0")
        self.maxsize = maxsize
        self._chunk = max(1, maxsize // _EVICT_FRACTION)
        self._entries: dict[int, None] = {}
        self._salts: dict[str, int] = {}
        self._fronts: dict[str, dict[str, int]] = {}
        self._front_size = min(_FRONT_ENTRIES, maxsize)
        self._front_left = self._front_size
        self.until = 0.0
        """Until when (``time.monotonic()``) the tier may answer: set by
        :class:`dedup._engine.invalidation.Invalidations` while this process provably
        hears every invalidation published on its channel; 0 (never) until then."""
        self.generation = 0
        """Counts the invalidations (and resets) this tier applied: a :meth:`stamp`."""
        self._recent: dict[int, int] = {}  # entry -> generation that invalidated it
        self._floor = 0  # stamps below it cannot be judged: what adds they bring is refused

    def answering(self) -> bool:
        """Whether the tier may answer now (its invalidation channel is heard: see
        :attr:`until`). A tier that may not answer still learns."""
        return time.monotonic() < self.until

    def stamp(self) -> int:
        """The tier's :attr:`generation` now: taken before a request to Redis or the
        database whose answer may add a value, and passed to :meth:`add` with it, so
        that a value invalidated while that request was out is not added back."""
        return self.generation

    @property
    def entries(self) -> dict[int, None]:
        """The keys, least recently used first, for a hot path that inlines the lookup.

        A reader that finds a key must move it to the end (``del`` then set to
        ``None``), as ``in`` does; only :meth:`add` may insert a new key.
        """
        return self._entries

    @property
    def fronts(self) -> dict[str, dict[str, int]]:
        """kind -> values of that kind lately answered from the tier, by their text (each
        with its entry in the tier), for a hot path that inlines the lookup (a value
        found there is saved); only :meth:`promote` adds to them."""
        return self._fronts

    def promote(self, kind: str, value: str, key: int) -> None:
        """Keep ``value``, a saved value of ``kind`` just answered from the tier by its
        entry ``key`` (:meth:`key`), by its text too (values of up to 128 characters).

        A value found by its text is not looked up in the tier, so the tier does not see
        that it is still in use: when the fronts are full, their entries are first made
        the most recently used in the tier (added again if evicted meanwhile), then the
        fronts are emptied. So a value answered from the fronts outlives the values the
        tier took in since (the fleet's saved values, say) as one answered from the tier
        does, and is not sent to Redis as a first sighting after they are emptied.
        """
        if len(value) > _FRONT_MAX_CHARS or not self._front_size:
            return
        if not self._front_left:  # full: start afresh; the hot values come back at once
            self._flush_fronts()
        front = self._fronts.get(kind)
        if front is None:
            front = self._fronts[kind] = {}
        if value not in front:
            front[value] = key
            self._front_left -= 1

    def _flush_fronts(self) -> None:
        """Make the fronts' entries the most recently used in the tier, then empty them."""
        entries = self._entries
        pop = entries.pop
        for front in self._fronts.values():
            for key in front.values():
                pop(key, None)
                entries[key] = None
        if len(entries) > self.maxsize:
            self._evict()
        self._fronts.clear()
        self._front_left = self._front_size

    @property
    def salts(self) -> dict[str, int]:
        """kind -> :func:`kind_salt` of the kinds added; a kind missing here has no entry."""
        return self._salts

    def key(self, kind: str, digest: bytes) -> int:
        """The entry of one value: its digest as a number, XOR its kind's salt."""
        return self._salt(kind) ^ int.from_bytes(digest, "little")

    def _salt(self, kind: str) -> int:
        salt = self._salts.get(kind)
        if salt is None:
            salt = kind_salt(kind)
            if len(self._salts) >= _MAX_SALTS:
                self._salts.clear()  # a memo: salts are recomputed, entries stay valid
            self._salts[kind] = salt
        return salt

    def __contains__(self, item: tuple[str, bytes]) -> bool:
        kind, digest = item
        salt = self._salts.get(kind)
        if salt is None or time.monotonic() >= self.until:
            return False
        entries = self._entries
        key = salt ^ int.from_bytes(digest, "little")
        if entries.pop(key, 0) is None:  # values are None: found, now move it to the end
            entries[key] = None
            return True
        return False

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, kind: str, digest: bytes, since: int | None = None) -> None:
        """Remember a value as saved, evicting the least recently used keys past ``maxsize``.

        ``since`` is the :meth:`stamp` taken before the request that found the value
        saved: if the value was invalidated after it (its row may be gone since), it is
        not added. None: the caller knows no invalidation can have overtaken it.
        """
        if not self.maxsize:
            return
        entries = self._entries
        key = self.key(kind, digest)
        if since is not None and since != self.generation and self.invalidated_since(key, since):
            return
        entries.pop(key, None)
        entries[key] = None
        if len(entries) > self.maxsize:
            self._evict()

    def add_many(self, kind: str, digests: list[bytes], since: int | None = None) -> None:
        """:meth:`add` of several values of one kind (the fleet's saved values, learned
        in bulk: one salt lookup and one eviction check for them all)."""
        if not self.maxsize or not digests:
            return
        entries, salt, from_bytes = self._entries, self._salt(kind), int.from_bytes
        pop = entries.pop
        judge = since is not None and since != self.generation
        for digest in digests:
            key = salt ^ from_bytes(digest, "little")
            if judge and self.invalidated_since(key, since):  # type: ignore[arg-type]
                continue
            pop(key, None)
            entries[key] = None
        if len(entries) > self.maxsize:
            self._evict()

    def discard(self, kind: str, value: str, digest: bytes) -> None:
        """Forget one value, by its entry and by its text (its row was deleted): this
        process stops answering it as saved."""
        salt = self._salts.get(kind)
        if salt is not None:  # no salt, no entry of this kind
            self._entries.pop(salt ^ int.from_bytes(digest, "little"), None)
        front = self._fronts.get(kind)
        if front is not None and front.pop(value, None) is not None:
            self._front_left += 1

    def invalidated_since(self, key: int, since: int) -> bool:
        """Whether entry ``key`` may have been invalidated after stamp ``since``."""
        return since < self._floor or self._recent.get(key, 0) > since

    def invalidate(self, kind: str, digests: Iterable[bytes]) -> None:
        """Forget values of ``kind`` by their digests (their rows are being deleted):
        this process stops answering them as saved, and refuses to add them back from an
        answer whose request went out before now (see :meth:`add`)."""
        self.generation = generation = self.generation + 1
        salt, from_bytes = self._salt(kind), int.from_bytes
        keys = {salt ^ from_bytes(d, "little") for d in digests}
        pop, recent = self._entries.pop, self._recent
        for key in keys:
            pop(key, None)
            recent.pop(key, None)  # re-inserted last: the dict stays in generation order
            recent[key] = generation
        front = self._fronts.get(kind)
        if front is not None:
            gone = [value for value, key in front.items() if key in keys]
            for value in gone:
                del front[value]
            self._front_left += len(gone)
        if len(recent) > _RECENT_MAX:
            # Drop the oldest half; stamps from before what was dropped are refused.
            for old in list(islice(recent, len(recent) // 2)):
                self._floor = max(self._floor, recent.pop(old))

    def reset(self) -> None:
        """Forget every entry and refuse every stamp taken before now: for a process
        that did not hear its invalidation channel for a while (it may have missed some)."""
        self.clear()
        self.generation += 1
        self._floor = self.generation
        self._recent.clear()

    def _evict(self) -> None:
        """Drop the least recently used keys past ``maxsize``, and a chunk more."""
        entries = self._entries
        excess = len(entries) - self.maxsize
        for old in list(islice(entries, excess + self._chunk - 1)):
            del entries[old]

    def clear(self) -> None:
        """Forget every key (used when the namespace is cleared)."""
        self._entries.clear()
        self._fronts.clear()
        self._front_left = self._front_size
