"""In-process pieces that need no server: keys, limits, the local tier, settings of scripts."""

from __future__ import annotations

import hashlib
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection

from dedup import InvalidInput
from dedup._claims.keys import KeySpace, MarkerLayout
from dedup._claims.scripts import ABORT, CLAIM, COMMIT
from dedup._engine.local import SavedCache
from dedup._redis.packing import fast_packing
from dedup._redis.script import Script
from dedup._redis.server import too_old
from dedup._values import Limits, digest, encode_payload, validate_kind, validate_value

LIMITS = Limits(max_value_bytes=64, max_payload_bytes=64)


def test_keys_hold_digests_only() -> None:
    space = KeySpace("ns")
    key = space.key("email", digest("secret@example.com"))
    assert key.startswith(b"ns:") and len(key) == 3 + 8 + 16
    assert b"secret" not in key and b"email" not in key
    assert space.key("email", digest("x")) != space.key("phone", digest("x"))
    assert space.match_pattern == b"ns:*"


def test_cluster_keys_carry_a_bounded_hash_tag() -> None:
    space = KeySpace("ns", cluster_shards=4)
    tags = {space.key("k", digest(str(i)))[3:6] for i in range(200)}
    assert tags == {b"{0}", b"{1}", b"{2}", b"{3}"}


@pytest.mark.parametrize("namespace", ["", "a*", "a{b}", "tab\t"])
def test_bad_namespaces(namespace: str) -> None:
    with pytest.raises(ValueError):
        KeySpace(namespace)


@settings(deadline=None, max_examples=200)
@given(st.text(max_size=80))
def test_any_text_value_is_accepted_or_rejected_cleanly(value: str) -> None:
    try:
        d = validate_value(value, LIMITS)
    except InvalidInput as exc:
        assert exc.field == "value"
        raw = value.encode("utf-8", "surrogatepass")
        assert len(raw) > 64 or "\x00" in value or any(0xD800 <= ord(c) < 0xE000 for c in value)
    else:
        assert d == hashlib.blake2b(value.encode(), digest_size=16).digest() == digest(value)


@settings(deadline=None, max_examples=200)
@given(st.one_of(st.none(), st.integers(), st.text(), st.binary(), st.lists(st.integers())))
def test_any_kind_is_accepted_or_rejected_cleanly(kind: object) -> None:
    try:
        assert validate_kind(kind) == kind
    except InvalidInput as exc:
        assert exc.field == "kind"


@settings(deadline=None, max_examples=200)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    )
)
def test_payloads_serialise_or_fail_typed(payload: object) -> None:
    try:
        text = encode_payload(payload, LIMITS)
    except InvalidInput as exc:
        assert exc.field == "payload"
    else:
        assert text is None or len(text.encode()) <= 64


def test_deep_payload_is_rejected() -> None:
    deep: object = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(InvalidInput, match="payload"):
        encode_payload(deep, Limits(max_value_bytes=10, max_payload_bytes=10_000))


def _heard(cache: SavedCache) -> SavedCache:
    """A tier that may answer (as while its invalidation channel is heard)."""
    cache.until = math.inf
    return cache


def test_saved_cache_answers_only_while_its_channel_is_heard() -> None:
    # A tier whose invalidation channel is not proved heard (until in the past) answers
    # nothing, but still learns; it answers again once the channel is heard.
    cache = SavedCache(10)
    item = ("k", digest("a"))
    cache.add(*item)
    assert not cache.answering() and item not in cache
    cache.until = time.monotonic() + 60
    assert cache.answering() and item in cache
    cache.until = time.monotonic() - 1
    assert item not in cache


def test_saved_cache_invalidate_drops_values_and_refuses_late_adds() -> None:
    # An invalidation drops a value by its entry and by its text; an answer to a
    # request sent before it (an older stamp) does not add the value back, one sent
    # after it does; other values and kinds are not touched.
    cache = _heard(SavedCache(100))
    gone, kept = digest("gone"), digest("kept")
    for d, text in ((gone, "gone"), (kept, "kept")):
        cache.add("k", d)
        cache.promote("k", text, cache.key("k", d))
    cache.add("other", gone)
    before = cache.stamp()
    cache.invalidate("k", [gone])
    assert ("k", gone) not in cache and "gone" not in cache.fronts["k"]
    assert ("k", kept) in cache and "kept" in cache.fronts["k"] and ("other", gone) in cache
    cache.add("k", gone, before)  # a claim sent before the invalidation: refused
    cache.add_many("k", [gone], before)
    assert ("k", gone) not in cache
    cache.add("k", kept, before)  # another value: not invalidated, so added
    assert ("k", kept) in cache
    cache.add("k", gone, cache.stamp())  # sent after it: the value was saved again
    assert ("k", gone) in cache


def test_saved_cache_reset_refuses_every_older_stamp() -> None:
    # After a reset (the channel was lost: invalidations may have been missed), the
    # tier is empty and answers to requests sent before it add nothing.
    cache = _heard(SavedCache(100))
    a, b = digest("a"), digest("b")
    cache.add("k", a)
    old = cache.stamp()
    cache.reset()
    assert len(cache) == 0
    cache.add("k", b, old)
    assert ("k", b) not in cache
    cache.add("k", b, cache.stamp())
    assert ("k", b) in cache


def test_saved_cache_forgets_old_invalidations_but_refuses_what_it_cannot_judge() -> None:
    # The invalidations remembered are bounded; a stamp older than the oldest one still
    # remembered cannot be judged, so what it brings is refused.
    cache = _heard(SavedCache(10))
    old = cache.stamp()
    for i in range(70_000):
        cache.invalidate("k", [i.to_bytes(16, "big")])
    recent = cache.stamp()
    cache.add("k", digest("never invalidated"), old)
    assert ("k", digest("never invalidated")) not in cache
    cache.add("k", digest("never invalidated"), recent)
    assert ("k", digest("never invalidated")) in cache


def test_saved_cache_is_a_bounded_lru() -> None:
    a, b, c, d = (("k", digest(v)) for v in "abcd")
    cache = _heard(SavedCache(3))
    for item in (a, b, c):
        cache.add(*item)
    assert a in cache  # a is now the most recent
    cache.add(*d)  # evicts b, the least recently used
    assert len(cache) == 3
    assert b not in cache
    assert all(item in cache for item in (a, c, d))
    assert ("other-kind", a[1]) not in cache  # the same value of another kind is another entry
    disabled = _heard(SavedCache(0))
    disabled.add(*a)
    assert a not in disabled and len(disabled) == 0
    with pytest.raises(ValueError):
        SavedCache(-1)


def test_saved_cache_fronts_keep_answered_values_by_text_bounded() -> None:
    # A value answered from the tier is kept by its text too (values of up to 128
    # characters); the fronts never hold more than 8,192 values (nor more than the
    # tier's size), are emptied when full, and cleared with the tier.
    cache = _heard(SavedCache(100_000))
    key, other = cache.key("k", b"\x01" * 16), cache.key("other", b"\x01" * 16)
    cache.promote("k", "a@example.com", key)
    cache.promote("k", "a@example.com", key)  # once is enough
    cache.promote("other", "a@example.com", other)
    cache.promote("k", "x" * 129, key)  # too long: found by its digest only
    assert cache.fronts == {"k": {"a@example.com": key}, "other": {"a@example.com": other}}
    for i in range(8192 - 2):
        cache.promote("k", f"v{i}", cache.key("k", i.to_bytes(16, "big")))
    assert sum(map(len, cache.fronts.values())) == 8192
    cache.promote("k", "one more", key)  # full: emptied, then this one kept
    assert cache.fronts == {"k": {"one more": key}}
    cache.clear()
    assert cache.fronts == {}
    small = _heard(SavedCache(3))
    for v in "abcd":
        small.promote("k", v, small.key("k", v.encode() * 16))
    assert sum(map(len, small.fronts.values())) <= 3
    disabled = _heard(SavedCache(0))
    disabled.promote("k", "a", 1)
    assert disabled.fronts == {}


def test_saved_cache_fronts_keep_their_values_in_the_tier() -> None:
    # A value answered from the fronts is never looked up in the tier, which then takes
    # in values enough to evict it; when the fronts are emptied, their values are made
    # the most recently used in the tier again (added back if evicted), so that the
    # value is still a local answer afterwards, not a first sighting sent to Redis.
    cache = _heard(SavedCache(20_000))
    hot = (b"\xaa" * 16, b"\xbb" * 16)
    for d in hot:
        cache.add("k", d)
        assert ("k", d) in cache
        cache.promote("k", d.hex(), cache.key("k", d))
    # Answered by their text from now on; meanwhile the tier fills with new values.
    newer = [i.to_bytes(16, "big") for i in range(20_000)]
    cache.add_many("k", newer)
    assert all(("k", d) not in cache for d in hot)  # aged out of the tier...
    for i in range(8_191):  # ...until the fronts fill up and are emptied
        cache.promote("k", f"v{i}", cache.key("k", (50_000 + i).to_bytes(16, "big")))
    assert all(d.hex() not in cache.fronts["k"] for d in hot)
    assert all(("k", d) in cache for d in hot)  # back in the tier
    assert len(cache) <= 20_000
    assert ("k", newer[-1]) in cache and ("k", newer[0]) not in cache  # LRU order kept


def test_saved_cache_discard_forgets_a_value_by_entry_and_by_text() -> None:
    # A value whose row was deleted (run-once forgets it): neither the tier nor the
    # fronts answer it any more; other values, and other kinds, stay.
    cache = _heard(SavedCache(100))
    gone, kept = digest("gone"), digest("kept")
    for d, text in ((gone, "gone"), (kept, "kept")):
        cache.add("k", d)
        cache.promote("k", text, cache.key("k", d))
    cache.add("other", gone)
    cache.discard("k", "gone", gone)
    assert ("k", gone) not in cache and "gone" not in cache.fronts["k"]
    assert ("k", kept) in cache and "kept" in cache.fronts["k"]
    assert ("other", gone) in cache
    cache.discard("unseen", "gone", gone)  # a kind never added: nothing to forget


def test_saved_cache_add_many_is_add_in_bulk() -> None:
    # The fleet's saved values are learned in bulk: the same entries, order and bound
    # as one add each.
    one, bulk = _heard(SavedCache(100)), _heard(SavedCache(100))
    digests = [digest(f"v{i}") for i in range(250)]
    one.add("k", digests[0])
    bulk.add("k", digests[0])
    for d in digests[1:]:
        one.add("k", d)
    bulk.add_many("k", digests[1:])
    bulk.add_many("k", [])
    assert len(bulk) == len(one) <= 100
    assert list(bulk.entries) == list(one.entries)
    assert ("k", digests[-1]) in bulk and ("k", digests[0]) not in bulk
    assert ("other", digests[-1]) not in bulk
    disabled = _heard(SavedCache(0))
    disabled.add_many("k", digests)
    assert len(disabled) == 0


def test_saved_cache_evicts_least_recently_used_first_and_stays_bounded() -> None:
    # A large cache evicts its oldest keys 1/64 of its size at a time: never more than
    # maxsize entries, and never a key used more recently than one it keeps.
    size = 6400
    cache = _heard(SavedCache(size))
    items = [("k", digest(f"v{i}")) for i in range(3 * size)]
    for item in items[:size]:
        cache.add(*item)
    hot, cold = items[: size // 2], items[size // 2 : size]
    assert len(cache) == size
    assert all(item in cache for item in cold)
    assert all(item in cache for item in hot)  # now the most recently used
    for n, item in enumerate(items[size:], start=1):
        for h in hot[n % 50 :: 50]:  # keep the first half in use
            assert h in cache
        cache.add(*item)
        assert len(cache) <= size
    assert all(h in cache for h in hot)  # used all along: never evicted
    recent = items[-(size - size // 64 - len(hot)) :]
    assert all(item in cache for item in recent)
    assert not any(item in cache for item in cold)  # least recently used: gone first


def test_scripts_have_stable_shas_and_headers() -> None:
    for source in (CLAIM, COMMIT, ABORT):
        script = Script(source)
        assert script.sha == hashlib.sha1(source.encode()).hexdigest()
        assert "-- KEYS:" in source and "-- ARGV" in source and "-- Returns:" in source


_ARG = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
)


@settings(deadline=None, max_examples=300)
@given(name=st.sampled_from(["EVALSHA", "GET", "SCRIPT LOAD", "HSET"]), args=st.lists(_ARG))
def test_fast_packing_sends_what_redis_py_sends(
    name: str, args: list[bytes | str | int | float]
) -> None:
    fast, plain = fast_packing(Connection)(), Connection()
    assert fast_packing(Connection) is type(fast)  # one subclass per class
    sent = b"".join(fast.pack_command(name, *args))
    assert sent == b"".join(plain.pack_command(name, *args))


def test_marker_locators_hold_the_bucket_index_and_the_field() -> None:
    # The documented layout, byte by byte: x = value digest XOR (kind digest twice); the
    # locator is x[1:4] (the bucket index, modulo buckets_per_tag) then x[4:4+field_bytes].
    for buckets, shards in ((65536, 0), (1000, 4), (1, 0)):
        layout, space = MarkerLayout(marker_buckets=buckets, cluster_shards=shards), KeySpace("n")
        for i in range(200):
            value_digest = digest(str(i))
            key = space.key("k", value_digest)
            kind = key[-24:-16]
            x = bytes(a ^ b for a, b in zip(value_digest, kind + kind, strict=True))
            loc = layout.locator(key)
            assert loc == x[1 : 4 + layout.field_bytes]
            (bucket,), field = layout.locate(key)
            assert field == x[4 : 4 + layout.field_bytes]
            assert bucket.endswith(b":%d" % (int.from_bytes(x[1:4]) % layout.buckets_per_tag))


def test_redis_older_than_6_is_named() -> None:
    assert too_old({"redis_version": "7.0.15"}) == []
    assert too_old({"redis_version": "7.4.1"}) == [] and too_old({"redis_version": "8.0"}) == []
    assert too_old({"redis_version": "6.2.14"}) == [] and too_old({"redis_version": "6.0.9"}) == []
    assert too_old({"redis_version": "5.0.7"}) == ["5.0.7"]
    cluster = {"a:1": {"redis_version": "7.0.15"}, "b:2": {"redis_version": "5.0.14"}}
    assert too_old(cluster) == ["5.0.14"]
    assert too_old({}) == [] and too_old({"redis_version": "unstable"}) == []
