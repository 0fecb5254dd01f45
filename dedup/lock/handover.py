"""Handover: a release that hands a plain lock straight to the contender of the same
client (:mod:`dedup.lock.gate`), granting it in the one script that releases it.

The holder's :class:`dedup.lock.Lock` decides whether its streak of handovers has run
long enough to yield to other clients' waiters instead; this module sends the script
and settles the contender with its outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from dedup._redis.script import Script
from dedup.lock.batch import call_script
from dedup.lock.gate import gate_for
from dedup.lock.release import RELEASE_CHANNEL
from dedup.lock.scripts import HANDOVER

__all__ = ["hand_over"]

_HANDOVER = Script(HANDOVER)


def hand_over(
    redis: Redis | RedisCluster,
    keys: Sequence[bytes],
    token: bytes,
    *,
    streak: int,
    yield_turn: bool,
    fence_memory_ms: int,
    release: Callable[[bytes, str], None],
) -> asyncio.Future[int] | None:
    """Release ``token``'s hold of the lock ``keys`` names (the lock, its fence counter
    and its waiting flag) by handing it to this client's contender for it, if one
    waits: a future of 0 when done (handed over, or released because other clients
    wait) or -1 when ``token`` does not hold the lock; None when nobody here waits
    (nothing sent).

    ``streak``: the handovers in a row that ended in this hold; ``yield_turn``: release
    to other clients' waiters if any flagged the lock, rather than hand over.
    ``release(token, what)`` releases a token in the background (a grant that nobody
    takes, or whose outcome is unknown)."""
    gate = gate_for(redis, keys[0], create=False)
    if gate is None:
        return None
    following = gate.contender
    if (
        following is None
        or following.trying
        or following.left
        or following.grant is not None
        or (following.promoted is not None and not following.promoted.done())
        or following.token == token
    ):
        return None
    loop = asyncio.get_running_loop()
    sent = loop.time()
    following.trying = True  # nobody else hands it over meanwhile
    args = [
        token,
        following.token,
        fence_memory_ms,
        following.lease_ms,
        "1" if yield_turn else "0",
        RELEASE_CHANNEL,
    ]
    outcome: asyncio.Future[int] = loop.create_future()

    def answered(call: asyncio.Future[Any]) -> None:
        following.trying = False
        if call.cancelled():
            outcome.cancel()
            return
        try:
            reply = call.result()
            status = int(reply[0])
        except Exception as exc:  # an error, or an answer that is not the script's
            # The outcome is unknown: the script may have given the lock to the
            # follower's token (its reply was lost, or it failed after its SET),
            # a grant nobody would know of; the follower's own attempts would
            # fail on that token until its lease ran out (never, without one).
            if not following.left:
                following.unsure = True  # it releases that token before trying again
            elif not following.acquired:
                # It gave up meanwhile: release that token for it.
                release(following.token, "release an unsure handover")
            # (Left holding the lock, it won it with its own attempt: the lock was
            # free, so this handover gave nothing, and that hold is its own.)
            outcome.set_exception(exc)
            return
        if status != 1:
            if status == 0:
                # Yielded: the follower wins the lock, if at all, by its own
                # attempt, which starts a new streak.
                following.polite = True
            outcome.set_result(status)
            return
        # A yield check that found no other client waiting starts a new streak.
        handed = 1 if yield_turn else streak + 1
        if following.left:
            # It gave up while the handover was on its way: release its grant.
            release(following.token, "release an unclaimed handover")
        else:
            following.grant = (int(reply[1]), sent, handed)
            following.waiter.event.set()
        outcome.set_result(0)

    call_script(redis, _HANDOVER, list(keys), args).add_done_callback(answered)
    return outcome
