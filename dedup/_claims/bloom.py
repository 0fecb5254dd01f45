"""The approximate mode: a Bloom filter on Redis bitmaps instead of exact markers.

A value whose ``k`` bits are all set has "probably" been saved and is answered as
saved without any write: with the configured false-positive rate, a new value is
never stored. That suits counting each event once (analytics), never exactly-once
writes. The bits are tested by the claim script, atomically with taking the lease,
and set by the commit script, atomically with dropping it, so a value whose write
failed is not marked (a Bloom filter cannot forget).

The filter is split into partitions, each a bitmap key named after the value's key
head (namespace and hash tag, hence in the lease key's Cluster slot); all ``k`` bits
of a value are in one partition, so a claim touches one bitmap per generation.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dedup._claims.keys import key_head

__all__ = ["MAX_PARTITION_BITS", "BloomLayout", "BloomSpec", "bloom_size"]

MAX_PARTITION_BITS = 1 << 26
"""Bits of one bitmap key at most (8 MiB): Redis allocates a bitmap up to its highest
bit at once, and one huge string is slow to copy, replicate or delete."""
_TAIL_BYTES = 24


def bloom_size(expected: int, fp_rate: float) -> tuple[int, int]:
    """The bits ``m`` and hash functions ``k`` of a Bloom filter holding ``expected``
    values with a false-positive rate of ``fp_rate``: m = -n ln p / (ln 2)^2, k = m/n ln 2
    (rounded, at least 1). About 9.6 bits (1.2 bytes) per value at 1 %."""
    if expected < 1:
        raise ValueError("expected must be >= 1")
    if not 0.0 < fp_rate < 1.0:
        raise ValueError("fp_rate must be between 0 and 1")
    m = math.ceil(-expected * math.log(fp_rate) / math.log(2) ** 2)
    k = max(1, round(m / expected * math.log(2)))
    return m, k


@dataclass(frozen=True, slots=True)
class BloomSpec:
    """Opt-in approximate mode: a filter sized for ``expected`` values (per retention
    generation when a retention is set) at a false-positive rate of ``fp_rate``."""

    expected: int
    fp_rate: float = 0.01

    def __post_init__(self) -> None:
        bloom_size(self.expected, self.fp_rate)  # validates


class BloomLayout:
    """Where a value's bits are: its partition key and ``k`` bit offsets in it.

    Partition key: ``<namespace>:[{tag}]b:<part>``, or ``...b<generation>:<part>``
    with a retention. Each hash tag has ``parts_per_tag`` partitions of
    ``partition_bits`` bits; positions are ``h1 + i*h2`` (Kirsch-Mitzenmacher) from a
    BLAKE2b of the key's kind and value digests.
    """

    __slots__ = ("k", "m", "partition_bits", "parts_per_tag")

    def __init__(
        self,
        spec: BloomSpec,
        *,
        cluster_shards: int = 0,
        max_partition_bits: int = MAX_PARTITION_BITS,
    ) -> None:
        self.m, self.k = bloom_size(spec.expected, spec.fp_rate)
        tags = max(1, cluster_shards)
        per_tag = -(-self.m // tags)
        self.parts_per_tag = max(1, -(-per_tag // max_partition_bits))
        # Whole bytes: a partition is created as a zero-filled string of its size.
        bits = -(-per_tag // self.parts_per_tag)
        self.partition_bits = max(64, (bits + 7) // 8 * 8)

    def locate(
        self, key: bytes, generations: Sequence[bytes] = (b"",)
    ) -> tuple[list[bytes], list[int]]:
        """The partition keys of ``key`` (a :meth:`KeySpace.key`), one per name in
        ``generations``, and its ``k`` bit offsets in them."""
        h = hashlib.blake2b(key[-_TAIL_BYTES:], digest_size=24).digest()
        part = int.from_bytes(h[:8]) % self.parts_per_tag
        h1 = int.from_bytes(h[8:16])
        h2 = int.from_bytes(h[16:]) | 1
        bits = self.partition_bits
        head = key_head(key)
        names = [b"%sb%s:%d" % (head, g, part) for g in generations]
        return names, [(h1 + i * h2) % bits for i in range(self.k)]
