"""Gateway.filter against real redis-server and PostgreSQL: forward each event once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from dedup import DedupError, Gateway, InvalidInput

DEADLINE_S = 60.0


@pytest.fixture
async def gw(redis_url: str, pg_url: str) -> AsyncIterator[Gateway]:
    async with Gateway(redis_url, pg_url) as gateway:
        yield gateway


async def agen(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        await asyncio.sleep(0)
        yield item


async def collect(it: AsyncIterator[Any]) -> list[Any]:
    async with asyncio.timeout(DEADLINE_S):
        return [item async for item in it]


async def test_yields_each_value_once_in_order(gw: Gateway) -> None:
    stream = ["a", "b", "a", "c", "b", "d", "a"]
    assert await collect(gw.filter(agen(stream), "event", batch_size=3)) == ["a", "b", "c", "d"]
    # Later streams: everything was forwarded already, except the new value.
    assert await collect(gw.filter(["d", "e", "a"], "event")) == ["e"]
    assert await gw.count_rows(["event"]) == 5


async def test_key_and_payload_of_dict_events(gw: Gateway) -> None:
    events = [{"id": f"e{i % 50}", "n": i} for i in range(200)]
    out = await collect(
        gw.filter(agen(events), "event", key=lambda e: e["id"], payload=lambda e: e)
    )
    assert out == events[:50]
    assert await gw.get("event", "e7") == {"id": "e7", "n": 7}


async def test_two_gateways_split_a_shared_stream(redis_url: str, pg_url: str) -> None:
    values = [f"v{i}" for i in range(500)]
    async with Gateway(redis_url, pg_url) as one, Gateway(redis_url, pg_url) as two:
        first, second = await asyncio.gather(
            collect(one.filter(agen(values), "event", batch_size=64)),
            collect(two.filter(agen(reversed(values)), "event", batch_size=16)),
        )
    assert sorted(first + second) == sorted(values)  # each forwarded once, by one of them


async def test_a_slow_stream_is_flushed_after_linger(gw: Gateway) -> None:
    go_on = asyncio.Event()

    async def slow() -> AsyncIterator[str]:
        yield "first"
        await go_on.wait()  # only once "first" came out of the filter
        yield "second"

    out = []
    async with asyncio.timeout(DEADLINE_S):
        async for item in gw.filter(slow(), "event", batch_size=100, linger_s=0.01):
            out.append(item)
            go_on.set()
    assert out == ["first", "second"]


async def test_breaking_out_early_cancels_the_read(gw: Gateway) -> None:
    never = asyncio.Event()

    async def endless() -> AsyncIterator[str]:
        yield "only"
        await never.wait()
        yield "unreachable"

    it = gw.filter(endless(), "event", linger_s=0)
    async with asyncio.timeout(DEADLINE_S):
        async for item in it:
            assert item == "only"
            break
        await it.aclose()


async def test_bad_input_is_typed(gw: Gateway) -> None:
    with pytest.raises(InvalidInput):
        gw.filter("abc", "event")
    with pytest.raises(InvalidInput):
        gw.filter(42, "event")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        gw.filter([], "")
    with pytest.raises(InvalidInput):
        gw.filter([], "event", batch_size=0)
    with pytest.raises(InvalidInput):
        gw.filter([], "event", linger_s=float("nan"))
    with pytest.raises(InvalidInput):
        gw.filter([], "event", key="id")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput) as info:
        await collect(gw.filter(agen(["ok", "ok2", 3]), "event"))
    assert info.value.index == 2
    with pytest.raises(InvalidInput) as info:
        await collect(gw.filter(["ok", "ok2"], "event", payload=lambda e: object()))
    assert info.value.index == 0


async def test_a_closed_gateway_raises(redis_url: str, pg_url: str) -> None:
    gw = Gateway(redis_url, pg_url)
    with pytest.raises(DedupError, match="not open"):
        await collect(gw.filter(["a"], "event"))
