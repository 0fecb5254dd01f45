"""Property-based fuzz of the library API: ``Gateway.save`` and ``Gateway.save_many``.

Against a real redis-server and PostgreSQL. Bad input of every kind (wrong types,
empty and over-long text, lone surrogates, NUL, NaN/Infinity, deep, huge or
unserialisable payloads, malformed batch items, huge batches) must raise a typed
error (:class:`InvalidInput`, or :class:`Overloaded` for a batch over
``max_pending``) BEFORE any work: no Redis key (so no lease), no statement, no
row. Good input must save, and the row must hold exactly what was given.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

import asyncpg
import orjson
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dedup import Gateway, InvalidInput, Overloaded, SaveResult
from dedup._values import digest

MAX_VALUE = 256
MAX_PAYLOAD = 2048
MAX_PENDING = 64
CALL_TIMEOUT_S = 30.0  # "nothing hangs": every call of the Gateway is bounded

_T = TypeVar("_T")

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


async def bounded(call: Awaitable[_T]) -> _T:
    """``call``, failing the test instead of hanging."""
    return await asyncio.wait_for(call, CALL_TIMEOUT_S)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture
async def gw(redis_url: str, pg_url: str) -> AsyncIterator[Gateway]:
    """Small limits, so that over-limit input is cheap to make.

    Shared writes off: under "auto" a gateway beats a heartbeat into Redis once a
    second (the key ``dedup:{w}:fleet``, one counted round trip), work of no save's
    that :class:`NoWork` would take for a save's. A lone gateway under "auto" saves
    exactly as with "off"."""
    async with Gateway(
        redis_url,
        pg_url,
        max_value_bytes=MAX_VALUE,
        max_payload_bytes=MAX_PAYLOAD,
        max_pending=MAX_PENDING,
        max_batch=MAX_PENDING,
        shared_writes="off",
    ) as gateway:
        yield gateway


@pytest.fixture
async def db(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_url)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def rds(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        yield client
    finally:
        await client.aclose()


class NoWork:
    """Snapshot of everything a save could touch; ``assert_untouched`` checks none moved."""

    def __init__(self, gw: Gateway, db: asyncpg.Connection, rds: aioredis.Redis) -> None:
        self.gw, self.db, self.rds = gw, db, rds
        self.before = gw.stats()

    async def assert_untouched(self) -> None:
        after = self.gw.stats()
        assert after.redis_round_trips == self.before.redis_round_trips, "Redis was called"
        assert after.db_statements == self.before.db_statements, "the database was called"
        assert self.gw.pending == 0
        # The namespace's own state (its marker epoch, what its guardian saw of the
        # database) is not a save's: only keys of values count.
        keys = [k async for k in self.rds.scan_iter(count=1000) if b"{dedup-state}" not in k]
        assert keys == [], "a key (a lease) was left in Redis"
        assert await self.db.fetchval("SELECT count(*) FROM dedup_items") == 0, "a row was saved"


# -------------------------------------------------------------------------- strategies

# What a kind may hold: letters, marks, numbers, punctuation, symbols, spaces of every
# width, private use; what it may not: controls, line separators, invisible formatting.
_kind_char = st.characters(categories=["L", "M", "N", "P", "S", "Zs", "Co"])
_forbidden_kind_char = st.characters(categories=["Cc", "Cs", "Zl", "Zp"]) | st.sampled_from(
    list("\u00ad\u061c\u180e\u200b\u200d\u200f\u202a\u202e\u2060\u2066\u2069\ufeff\ufffe\uffff")
)
_text_char = st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
_surrogate = st.characters(categories=["Cs"])

good_kind = st.one_of(
    st.sampled_from(["email", "phone", "fz.kind"]),
    st.text(_kind_char, min_size=1, max_size=128),
)
good_value = st.one_of(
    st.text(_text_char, max_size=40),
    st.just(""),
    st.just("v" * MAX_VALUE),  # exactly at the limit
    st.integers(0, MAX_VALUE // 4).map(lambda n: "\N{GRINNING FACE}" * n),  # 4 bytes each
    st.just("\\u0000 is six characters, not a NUL"),
)
_json_text = st.text(_text_char, max_size=10)
good_payload = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        _json_text,
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_json_text, inner, max_size=4),
    max_leaves=10,
)


def _insert(text: st.SearchStrategy[str], bad: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """``text`` with one ``bad`` character put somewhere in it."""
    return st.tuples(text, bad, st.integers(0, 40)).map(
        lambda t: t[0][: t[2]] + t[1] + t[0][t[2] :]
    )


def _nest(depth: int) -> Any:
    node: Any = "leaf"
    for _ in range(depth):
        node = {"d": [node]}
    return node


_wrong_types = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.binary(max_size=8),
    st.lists(st.text(max_size=3), max_size=2),
    st.tuples(st.text(max_size=3)),
    st.builds(object),
    st.booleans(),
)
bad_kind = st.one_of(
    _wrong_types,
    st.just(""),
    st.text(_kind_char, min_size=129, max_size=200),
    _insert(st.text(_kind_char, max_size=10), _forbidden_kind_char),
)
bad_value = st.one_of(
    _wrong_types,
    _insert(st.text(_text_char, max_size=20), _surrogate),
    _insert(st.text(_text_char, max_size=20), st.just("\x00")),
    st.integers(MAX_VALUE + 1, MAX_VALUE * 8).map(lambda n: "x" * n),
    # Few characters, many bytes: the limit is in UTF-8 bytes.
    st.integers(MAX_VALUE // 2 + 1, MAX_VALUE).map(
        lambda n: "\N{LATIN SMALL LETTER E WITH ACUTE}" * n
    ),
)
_non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
bad_payload = st.one_of(
    st.builds(object),
    st.sets(st.integers(), min_size=1, max_size=3),
    st.binary(max_size=8),
    st.complex_numbers(allow_nan=False, allow_infinity=False),
    st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
    _non_finite,
    _non_finite.map(lambda x: {"a": [1, {"b": x}]}),
    _non_finite.map(lambda x: [None, (x,)]),
    st.integers(2**64, 2**80),
    st.integers(-(2**80), -(2**63) - 1),
    st.integers(MAX_PAYLOAD - 1, MAX_PAYLOAD * 4).map(lambda n: "p" * n),  # + 2 quotes > limit
    st.integers(MAX_PAYLOAD // 2, MAX_PAYLOAD).map(lambda n: list(range(n))),  # >= 2986 bytes
    st.integers(300, 2000).map(_nest),  # deeper than any JSON encoder here goes
    _insert(_json_text, _surrogate),
    _insert(_json_text, _surrogate).map(lambda k: {k: 1}),
    _insert(_json_text, st.just("\x00")),
    _insert(_json_text, st.just("\x00")).map(lambda k: {"ok": [{k: 1}]}),
)

# (kind, value, payload, the field InvalidInput must name): exactly one field is bad.
bad_save = st.one_of(
    st.tuples(bad_kind, good_value, good_payload, st.just("kind")),
    st.tuples(good_kind, bad_value, good_payload, st.just("value")),
    st.tuples(good_kind, good_value, bad_payload, st.just("payload")),
)
good_item = st.one_of(
    st.tuples(good_kind, good_value),
    st.tuples(good_kind, good_value, good_payload),
)
malformed_item = st.one_of(
    st.just(("k",)),
    st.tuples(good_kind, good_value, good_payload, st.none()),  # four fields
    st.tuples(good_kind, good_value).map(list),  # a list, not a tuple
    st.fixed_dictionaries({"kind": good_kind, "value": good_value}),
    st.text(max_size=5),
    st.none(),
    st.integers(),
)
bad_item = st.one_of(
    bad_save.map(lambda c: (c[0], c[1], c[2])),
    bad_save.map(lambda c: (c[0], c[1]) if c[3] != "payload" else (c[0], c[1], c[2])),
    malformed_item,
)


# -------------------------------------------------------------------------------- save


@FUZZ
@given(case=bad_save)
async def test_fuzz_bad_save_is_invalid_input_before_any_work(
    gw: Gateway, db: asyncpg.Connection, rds: aioredis.Redis, case: tuple[Any, Any, Any, str]
) -> None:
    kind, value, payload, field = case
    guard = NoWork(gw, db, rds)
    with pytest.raises(InvalidInput) as caught:
        await bounded(gw.save(kind, value, payload))
    assert isinstance(caught.value, ValueError)
    assert caught.value.field == field and caught.value.index is None, caught.value
    assert str(caught.value)
    event(f"bad {field}")
    await guard.assert_untouched()


async def _row(db: asyncpg.Connection, kind: str, value: str) -> asyncpg.Record | None:
    row: asyncpg.Record | None = await db.fetchrow(
        "SELECT value, payload::text AS payload FROM dedup_items WHERE kind = $1 AND digest = $2",
        kind,
        digest(value),
    )
    return row


async def _assert_row(db: asyncpg.Connection, kind: str, value: str, payload: Any) -> None:
    """The row of (kind, value) holds ``value`` and the JSON of ``payload``, exactly."""
    row = await _row(db, kind, value)
    assert row is not None, (kind, value)
    assert row["value"] == value
    if payload is None:
        assert row["payload"] is None
    else:
        # Compared by PostgreSQL's jsonb equality: numbers as numbers, keys unordered.
        same = await db.fetchval(
            "SELECT payload = $3::jsonb FROM dedup_items WHERE kind = $1 AND digest = $2",
            kind,
            digest(value),
            orjson.dumps(payload).decode(),
        )
        assert same, (row["payload"], payload)


@FUZZ
@given(kind=good_kind, value=good_value, payload=st.none() | good_payload)
async def test_fuzz_good_save_round_trips(
    gw: Gateway, db: asyncpg.Connection, kind: str, value: str, payload: Any
) -> None:
    # Hypothesis repeats examples: the first save of a value creates it, the others do not.
    first = await _row(db, kind, value) is None
    stored = payload if first else await _stored_payload(db, kind, value)
    result = await bounded(gw.save(kind, value, payload))
    assert result.created == first == (result.source == "write"), result
    await _assert_row(db, kind, value, stored)


async def _stored_payload(db: asyncpg.Connection, kind: str, value: str) -> Any:
    row = await _row(db, kind, value)
    assert row is not None
    return None if row["payload"] is None else orjson.loads(row["payload"])


# --------------------------------------------------------------------------- save_many


@st.composite
def batch_with_bad_items(draw: st.DrawFn) -> tuple[list[Any], int]:
    """A batch with at least one bad item, and the index of the first."""
    good = draw(st.lists(good_item, max_size=12))
    bad = draw(st.lists(bad_item, min_size=1, max_size=3))
    batch: list[Any] = list(good)
    positions: list[int] = []
    for item in bad:
        at = draw(st.integers(0, len(batch)))
        batch.insert(at, item)
        positions = [p + (p >= at) for p in positions] + [at]
    return batch, min(positions)


@FUZZ
@given(case=batch_with_bad_items())
async def test_fuzz_bad_batch_saves_nothing(
    gw: Gateway, db: asyncpg.Connection, rds: aioredis.Redis, case: tuple[list[Any], int]
) -> None:
    batch, first_bad = case
    guard = NoWork(gw, db, rds)
    with pytest.raises(InvalidInput) as caught:
        await bounded(gw.save_many(batch))
    assert caught.value.index == first_bad, (caught.value, batch)
    assert str(caught.value).startswith(f"item {first_bad}: ")
    await guard.assert_untouched()


@FUZZ
@given(batch=st.lists(good_item, max_size=20))
async def test_fuzz_good_batch_saves_every_item(
    gw: Gateway, db: asyncpg.Connection, batch: list[Any]
) -> None:
    known = {(i[0], i[1]): await _row(db, i[0], i[1]) is not None for i in batch}
    expected: dict[tuple[str, str], Any] = {}
    for item in batch:  # the first item of a new value brings the payload
        key = (item[0], item[1])
        if key not in expected:
            expected[key] = (
                await _stored_payload(db, *key)
                if known[key]
                else (item[2] if len(item) == 3 else None)
            )
    results: list[SaveResult] = await bounded(gw.save_many(batch))
    assert len(results) == len(batch)
    created: set[tuple[str, str]] = set()
    for item, result in zip(batch, results, strict=True):
        key = (item[0], item[1])
        assert result.created == (result.source == "write")
        if result.created:
            assert key not in created and not known[key], (item, result)
            created.add(key)
    assert created == {k for k, was in known.items() if not was}, "every new value created once"
    for (kind, value), payload in expected.items():
        await _assert_row(db, kind, value, payload)


# ---------------------------------------------------------------------------- explicit


async def test_batch_over_max_pending_is_overloaded_and_saves_nothing(
    gw: Gateway, db: asyncpg.Connection, rds: aioredis.Redis
) -> None:
    guard = NoWork(gw, db, rds)
    huge = [("fz", f"v{i}") for i in range(MAX_PENDING + 1)]
    with pytest.raises(Overloaded, match="max_pending"):
        await bounded(gw.save_many(huge))
    # A huge batch whose LAST item is bad is refused whole, naming that item.
    long_bad: list[Any] = [("fz", f"v{i}") for i in range(20_000)] + [("fz", 7)]
    with pytest.raises(InvalidInput) as caught:
        await bounded(gw.save_many(long_bad))
    assert caught.value.index == 20_000 and caught.value.field == "value"
    # Not a batch at all (nothing to iterate, or a string or mapping that iterates
    # but not as items): a typed error naming the argument, before any work.
    for nothing in (None, 5, "fz", b"fz", {"fz": "a"}):
        with pytest.raises(InvalidInput, match="iterable of tuples") as refused:
            await bounded(gw.save_many(nothing))  # type: ignore[arg-type]
        assert refused.value.field == "items" and refused.value.index is None

    def items_then_crash() -> Iterator[Any]:
        yield ("fz", "a")
        raise RuntimeError("the caller's iterator failed")

    with pytest.raises(RuntimeError, match="iterator failed"):
        await bounded(gw.save_many(items_then_crash()))
    await guard.assert_untouched()
    # A batch of exactly max_pending is fine.
    results = await bounded(gw.save_many(huge[:MAX_PENDING]))
    assert all(r.created for r in results)
    assert await db.fetchval("SELECT count(*) FROM dedup_items") == MAX_PENDING


async def test_default_limits_at_and_over_the_edge(
    redis_url: str, pg_url: str, db: asyncpg.Connection, rds: aioredis.Redis
) -> None:
    """The documented defaults: values up to 8192 UTF-8 bytes, payloads up to 65536 as JSON."""
    async with Gateway(redis_url, pg_url, shared_writes="off") as gw:  # no heartbeat: see gw
        guard = NoWork(gw, db, rds)
        over = [
            ("k", "x" * 8193, None, "value"),
            ("k", "\N{EURO SIGN}" * 2731, None, "value"),  # 2731 characters, 8193 bytes
            ("k", "x", "p" * 65535, "payload"),  # 65537 bytes as JSON
            ("k" * 129, "x", None, "kind"),
            ("k", "x", {"n": math.nan}, "payload"),
            ("k", "x", _nest(300), "payload"),
        ]
        for kind, value, payload, field in over:
            with pytest.raises(InvalidInput) as caught:
                await bounded(gw.save(kind, value, payload))
            assert caught.value.field == field, caught.value
        await guard.assert_untouched()
        at_limit = [
            ("k", "x" * 8192, None),
            ("k", "\N{EURO SIGN}" * 2730 + "xx", None),  # 8192 bytes
            ("k", "y", "p" * 65534),  # 65536 bytes as JSON
            ("k" * 128, "z", None),
            ("k", "deep", _nest(120)),
            ("k", "backslash", {"text": "\\u0000", "\\u0000": ["\\\\u0000"]}),
        ]
        for kind, value, payload in at_limit:
            assert (await bounded(gw.save(kind, value, payload))).created
            await _assert_row(db, kind, value, payload)
