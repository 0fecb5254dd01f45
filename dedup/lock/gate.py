"""Blocked acquires of one lock name on one client, queued in the process.

Only the first blocked acquire of a name (the contender) tries on the server; the others
queue in its :class:`Gate`, so a hot name costs one waiter per process rather than one per
task, and a release by a holder of the same client hands the lock straight to the
contender in one script.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import weakref
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from dedup.lock.release import (
    Waiter,
)

__all__ = ["GATES", "Contender", "Gate", "forget_gate", "gate_for"]


class Contender:
    """One blocked acquire of a plain lock: its token and lease, what wakes it, and a
    grant handed over by a holder of the same client."""

    __slots__ = (
        "acquired",
        "grant",
        "lease_ms",
        "left",
        "polite",
        "promoted",
        "token",
        "trying",
        "unsure",
        "waiter",
    )

    def __init__(self, token: bytes, lease_ms: int, key: bytes) -> None:
        self.token = token
        self.lease_ms = lease_ms
        self.waiter = Waiter(key)  # replaced by the release listener's waiter, if any
        self.promoted: asyncio.Future[bool] | None = None
        # (fence, sent, streak) of a handover: streak is the handovers in a row that
        # this grant ends, carried to the Lock that takes it, since the gate that
        # counted them may be forgotten between two handovers.
        self.grant: tuple[int, float, int] | None = None
        self.trying = False  # an attempt is in flight
        # Its client's holder just yielded to other clients: let the signal of that
        # release pass, and try on the next one (or after a short grace).
        self.polite = False
        # A handover to it, or an attempt of its own, failed with an unknown outcome: the
        # lock may be held by its token, which no grant told it of. It releases that
        # token before trying again (or acquire() does, if it gives up first).
        self.unsure = False
        self.left = False
        self.acquired = False  # it left holding the lock


class Gate:
    """The blocked acquires of one lock name on one client and event loop: only the
    first (``contender``) tries on the server; the others queue here, so that a hot
    name costs one waiter per process, not one per task; and a release by a holder
    of this client hands the lock straight to the contender (one round trip for a
    release and a grant, no signal, no race)."""

    __slots__ = ("contender", "loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.contender: Contender | None = None
        self.queue: collections.deque[Contender] = collections.deque()

    def leave(self, contender: Contender, acquired: bool) -> None:
        """``contender`` stops trying (it holds the lock, gave up or failed): the next
        in line becomes the contender; told to wait for a handover first if the lock
        is held here."""
        contender.left = True
        contender.acquired = acquired
        if self.contender is not contender:
            with contextlib.suppress(ValueError):
                self.queue.remove(contender)
            return
        self.contender = None
        while self.queue:
            following = self.queue.popleft()
            if following.left or following.promoted is None or following.promoted.done():
                continue
            self.contender = following
            following.promoted.set_result(acquired)
            return


GATES: weakref.WeakKeyDictionary[Any, dict[bytes, Gate]] = weakref.WeakKeyDictionary()


def gate_for(client: Redis | RedisCluster, key: bytes, *, create: bool) -> Gate | None:
    loop = asyncio.get_running_loop()
    gates = GATES.get(client)
    if gates is None:
        if not create:
            return None
        gates = GATES[client] = {}
    gate = gates.get(key)
    if gate is not None and gate.loop is not loop:
        gate = None
    if gate is None and create:
        gate = gates[key] = Gate(loop)
    return gate


def forget_gate(client: Redis | RedisCluster, key: bytes, gate: Gate) -> None:
    gates = GATES.get(client)
    if gates is not None and gates.get(key) is gate and gate.contender is None and not gate.queue:
        del gates[key]
