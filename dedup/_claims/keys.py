"""Redis key names and the compact marker layout, from a value's digest.

A value never appears in a key: keys are built from a 128-bit BLAKE2b digest of
the value and a 64-bit digest of its kind, so a key's length is fixed and no
user text reaches Redis key space.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from dedup._values import DIGEST_BYTES

__all__ = [
    "DEFAULT_MARKER_BUCKETS",
    "LAYOUTS",
    "MARKER_BITS",
    "KeySpace",
    "MarkerLayout",
    "derive_key",
    "key_head",
]

_KIND_DIGEST_BYTES = 8
_TAIL_BYTES = _KIND_DIGEST_BYTES + DIGEST_BYTES  # what follows the head in every key

LAYOUTS = ("compact", "keys")
"""Where "saved" markers live: ``compact`` (fields of hash buckets, the default) or
``keys`` (one key per value holding ``"1"``, the layout before compact markers)."""
MARKER_BITS = 96
"""Bits of a value's digest that the bucket name and the field of its compact marker
hold at least: a new value is answered "saved" by mistake with a chance of at most
N / 2**96 when N values are saved."""
DEFAULT_MARKER_BUCKETS = 65536
_MAX_BUCKETS_PER_TAG = 1 << 24  # the bucket index comes from 3 bytes of the digest


class KeySpace:
    """Builds the Redis key of a (kind, value digest) inside one namespace.

    Layout: ``<namespace>:`` + optional ``{shard}`` hash tag + 8-byte kind digest
    + 16-byte value digest. The hash tag (``cluster_shards > 0``) groups keys into
    a fixed number of Redis Cluster slots so that one script call serves many keys.

    With a ``secret`` both digests in the key are keyed by it (BLAKE2b's keyed mode),
    so that someone who can read Redis but lacks the secret cannot test whether a
    guessed value was saved by computing its key; the database keeps the plain digest.
    """

    __slots__ = ("_key", "_kinds", "cluster_shards", "prefix")

    def __init__(self, namespace: str, *, cluster_shards: int = 0, secret: bytes = b"") -> None:
        if not namespace or not namespace.isprintable() or any(c in namespace for c in "{}*?[]"):
            raise ValueError("namespace must be non-empty printable text without {}*?[] characters")
        if cluster_shards < 0:
            raise ValueError("cluster_shards must be >= 0")
        self.prefix = namespace.encode() + b":"
        self.cluster_shards = cluster_shards
        self._kinds: dict[str, bytes] = {}
        self._key = derive_key(secret, b"keys") if secret else b""

    def key(self, kind: str, value_digest: bytes) -> bytes:
        """The Redis key of one value of one kind."""
        kind_part = self._kinds.get(kind)
        if kind_part is None:
            kind_part = hashlib.blake2b(
                kind.encode(), digest_size=_KIND_DIGEST_BYTES, key=self._key
            ).digest()
            if len(self._kinds) < 4096:  # kinds are few; bound the cache anyway
                self._kinds[kind] = kind_part
        if self._key:
            value_digest = hashlib.blake2b(
                value_digest, digest_size=DIGEST_BYTES, key=self._key
            ).digest()
        if self.cluster_shards:
            shard = b"{%d}" % (value_digest[0] % self.cluster_shards)
            return self.prefix + shard + kind_part + value_digest
        return self.prefix + kind_part + value_digest

    @property
    def match_pattern(self) -> bytes:
        """A SCAN pattern matching every key of this namespace (leases, markers, buckets)."""
        return self.prefix + b"*"


def derive_key(secret: bytes, purpose: bytes) -> bytes:
    """A 32-byte key for one ``purpose`` from the user's ``shared_secret``: one secret
    serves key names and message signatures without the two uses sharing a key."""
    return hashlib.blake2b(secret, digest_size=32, person=b"dedup:" + purpose).digest()


def key_head(key: bytes) -> bytes:
    """The namespace and hash tag of a key from :meth:`KeySpace.key`: the part that
    the key's bucket shares with it, so that both live in one Cluster slot."""
    return key[:-_TAIL_BYTES]


class MarkerLayout:
    """Where the compact layout keeps the "saved" marker of a value.

    A marker is a field of a small hash, a bucket, named after the value's key head
    (namespace and hash tag, hence the same Cluster slot as the lease key):

    * bucket ``<namespace>:[{tag}]m:<index>``, or ``...m<generation>:<index>`` when
      markers are kept for a retention period;
    * field: ``field_bytes`` raw bytes (10 by default), value ``"1"``.

    Both come from ``x`` = the value digest XOR the kind digest (twice): buckets are
    shared by all kinds of a namespace, so a few values of many kinds still fill them.
    The index is ``x[1:4] % buckets_per_tag`` and the field ``x[4:4+field_bytes]``;
    the shard tag comes from the digest's byte 0. Index, tag and field use disjoint
    bytes, so together they hold ``guaranteed_bits`` >= :data:`MARKER_BITS` bits.
    """

    __slots__ = (
        "_kinds",
        "_locator_bytes",
        "_locator_mask",
        "_shift",
        "buckets_per_tag",
        "field_bytes",
        "guaranteed_bits",
    )

    def __init__(self, *, marker_buckets: int = DEFAULT_MARKER_BUCKETS, cluster_shards: int = 0):
        if not 1 <= marker_buckets <= _MAX_BUCKETS_PER_TAG:
            raise ValueError(f"marker_buckets must be 1 to {_MAX_BUCKETS_PER_TAG}")
        if cluster_shards < 0:
            raise ValueError("cluster_shards must be >= 0")
        tags = max(1, cluster_shards)
        self.buckets_per_tag = max(1, -(-marker_buckets // tags))
        # Bits the bucket's name carries for sure: its index, and the tag when the tag is
        # a uniform function of byte 0 (a count of tags that divides 256).
        name_bits = self.buckets_per_tag.bit_length() - 1
        if 256 % tags == 0:
            name_bits += tags.bit_length() - 1
        self.field_bytes = min(12, -(-(MARKER_BITS - name_bits) // 8))
        self.guaranteed_bits = name_bits + 8 * self.field_bytes
        self._shift = 96 - 8 * self.field_bytes
        self._locator_bytes = 3 + self.field_bytes
        self._locator_mask = (1 << 8 * self._locator_bytes) - 1
        self._kinds: dict[bytes, int] = {}

    def locate(
        self, key: bytes, generations: Sequence[bytes] = (b"",)
    ) -> tuple[list[bytes], bytes]:
        """The buckets of ``key`` (a :meth:`KeySpace.key`), one per name in
        ``generations`` (``b""`` when markers never expire), and its field: what the
        compact scripts derive from :meth:`locator` (for tools and tests)."""
        loc = self.locator(key)
        index = int.from_bytes(loc[:3]) % self.buckets_per_tag
        head = key[:-_TAIL_BYTES]
        return [b"%sm%s:%d" % (head, g, index) for g in generations], loc[3:]

    def locator(self, key: bytes) -> bytes:
        """What the compact scripts need besides ``key`` to find its marker: the 3 bytes
        whose value modulo ``buckets_per_tag`` is the bucket index, then the field (the
        scripts name the bucket themselves, as :meth:`locate` does)."""
        kind = key[-_TAIL_BYTES:-DIGEST_BYTES]
        mask = self._kinds.get(kind)
        if mask is None:
            mask = int.from_bytes(kind + kind)
            if len(self._kinds) < 4096:  # kinds are few; bound the cache anyway
                self._kinds[kind] = mask
        # x[1:4] and x[4:4+field_bytes] of x = digest XOR kind digest twice, as 16 bytes,
        # read off the integer (the hot path: claims and commits locate every key).
        x = int.from_bytes(key[-DIGEST_BYTES:]) ^ mask
        return (x >> self._shift & self._locator_mask).to_bytes(self._locator_bytes)

    def collision_chance(self, saved: float, new: float) -> float:
        """The chance that any of ``new`` values is taken for one of ``saved`` ones."""
        return saved * new / 2.0**self.guaranteed_bits
