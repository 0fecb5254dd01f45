"""The in-process tier: an LRU of values known saved.

"Saved" is monotonic (a committed row stays committed), so a hit needs no
network and never goes stale. Only committed values enter; nothing in progress.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["SavedCache"]


class SavedCache:
    """A bounded LRU set of keys whose rows are known committed.

    ``maxsize == 0`` disables the tier.
    """

    __slots__ = ("_entries", "maxsize")

    def __init__(self, maxsize: int) -> None:
        if maxsize < 0:
            raise ValueError("local_cache_size must be >= 0")
        self.maxsize = maxsize
        self._entries: OrderedDict[bytes, None] = OrderedDict()

    @property
    def entries(self) -> OrderedDict[bytes, None]:
        """The ordered keys, oldest first, for a hot path that inlines the lookup.

        A reader that finds a key must ``move_to_end`` it, as ``in`` does; only
        :meth:`add` may insert.
        """
        return self._entries

    def __contains__(self, key: bytes) -> bool:
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
            return True
        return False

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: bytes) -> None:
        """Remember ``key`` as saved, evicting the least recently used key past ``maxsize``."""
        if not self.maxsize:
            return
        entries = self._entries
        entries[key] = None
        entries.move_to_end(key)
        if len(entries) > self.maxsize:
            entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every key (used when the namespace is cleared)."""
        self._entries.clear()
