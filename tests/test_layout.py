"""The compact marker layout: bucket names, fields and the bits they keep (no server)."""

from __future__ import annotations

from collections import Counter

import pytest
from redis.crc import key_slot

from dedup._claims.keys import DEFAULT_MARKER_BUCKETS, MARKER_BITS, KeySpace, MarkerLayout, key_head
from dedup._values import digest


def test_default_layout_keeps_96_bits_in_10_byte_fields() -> None:
    layout = MarkerLayout()
    assert layout.buckets_per_tag == DEFAULT_MARKER_BUCKETS == 65536
    assert (layout.field_bytes, layout.guaranteed_bits) == (10, 96)
    # The DESIGN bound: below 1e-5 over 10^12 values (about 6.3e-6).
    assert layout.collision_chance(1e12, 1e12) / 2 < 1e-5


@pytest.mark.parametrize(
    ("buckets", "shards", "per_tag", "field", "bits"),
    [
        (65536, 0, 65536, 10, 96),
        (65536, 64, 1024, 10, 96),  # 6 bits of tag + 10 of index
        (65536, 16, 4096, 10, 96),
        (65536, 10, 6554, 11, 100),  # 10 tags do not divide 256: their bits are not counted
        (4096, 0, 4096, 11, 100),
        (1, 0, 1, 12, 96),
        (1 << 24, 0, 1 << 24, 9, 96),
    ],
)
def test_field_bytes_cover_what_the_bucket_name_does_not(
    buckets: int, shards: int, per_tag: int, field: int, bits: int
) -> None:
    layout = MarkerLayout(marker_buckets=buckets, cluster_shards=shards)
    assert (layout.buckets_per_tag, layout.field_bytes, layout.guaranteed_bits) == (
        per_tag,
        field,
        bits,
    )
    assert layout.guaranteed_bits >= MARKER_BITS


def test_bad_sizes_are_refused() -> None:
    for buckets in (0, (1 << 24) + 1):
        with pytest.raises(ValueError, match="marker_buckets"):
            MarkerLayout(marker_buckets=buckets)
    with pytest.raises(ValueError, match="cluster_shards"):
        MarkerLayout(cluster_shards=-1)


def test_bucket_names_and_fields() -> None:
    space, layout = KeySpace("ns"), MarkerLayout(marker_buckets=1000)
    key = space.key("email", digest("a@example.com"))
    (bucket,), field = layout.locate(key)
    assert bucket.startswith(b"ns:m:") and 0 <= int(bucket[5:]) < 1000
    assert len(field) == 11 and field not in key  # a mix of kind and value, not a slice
    (again,), same = layout.locate(key)
    assert (again, same) == (bucket, field)
    gens, field2 = layout.locate(key, [b"12", b"11"])
    assert gens == [b"ns:m12:" + bucket[5:], b"ns:m11:" + bucket[5:]] and field2 == field
    assert space.match_pattern == b"ns:*"  # purge finds buckets too
    # Another kind, same value: another marker.
    other = layout.locate(space.key("phone", digest("a@example.com")))
    assert other != ([bucket], field)


def test_buckets_share_the_lease_keys_hash_tag_and_slot() -> None:
    space, layout = KeySpace("ns", cluster_shards=16), MarkerLayout(cluster_shards=16)
    for i in range(300):
        key = space.key("k", digest(str(i)))
        buckets, _ = layout.locate(key, [b"7", b"6"])
        assert key_head(key) == key[: key.index(b"}") + 1]
        for bucket in buckets:
            assert bucket.startswith(key_head(key) + b"m")
            assert key_slot(bucket) == key_slot(key)


def test_kinds_share_buckets_and_fill_them_evenly() -> None:
    space, layout = KeySpace("ns"), MarkerLayout(marker_buckets=64)
    fill: Counter[bytes] = Counter()
    markers = set()
    for kind in ("a", "b", "c", "d"):
        for i in range(2000):
            (bucket,), field = layout.locate(space.key(kind, digest(str(i))))
            fill[bucket] += 1
            markers.add((bucket, field))
    assert len(markers) == 8000  # no two (kind, value) pairs share a marker
    assert len(fill) == 64
    assert max(fill.values()) < 1.4 * 8000 / 64 and min(fill.values()) > 0.6 * 8000 / 64
