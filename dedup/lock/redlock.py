"""Redlock: one lock over N independent Redis masters, held when a majority grants it.

The algorithm (antirez, "Distributed locks with Redis"): read the monotonic clock;
ask every node, in parallel and each with a timeout far below the TTL, to
``SET key token NX PX ttl``; the lock is held when at least ``N // 2 + 1`` nodes
said yes and the time that took leaves some validity:
``validity = ttl - elapsed - drift`` with ``drift = 1% of ttl + 2 ms``. Otherwise
the attempt is undone on every node (a node may have granted although its answer
was lost) and retried after a random delay.

A node restarted without its data could grant the lock a second time while the
first holder's grant is still valid elsewhere. So a node whose uptime is below
the TTL does not vote: its acquire script answers "abstain" (see ``ACQUIRE``).

What Redlock cannot give: a fencing token. Each node's clock and counter are its
own, so no number read from a majority grows strictly from one grant to the
next. Use :class:`dedup.lock.Lock` with fences, or the database's unique key,
where a double write must be impossible (see docs/locks.md).

This module depends only on :mod:`dedup._claims.scripts` and :mod:`dedup.errors`, so that
:mod:`dedup.lock` can re-export :class:`Redlock` without an import cycle.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections.abc import Sequence
from types import SimpleNamespace, TracebackType
from typing import Any, Literal, Self

from redis.asyncio import Redis
from redis.exceptions import RedisError

from dedup._redis.script import Script
from dedup.errors import ConfigError
from dedup.lock.batch import call_script
from dedup.lock.errors import LockError, LockNotOwned, QuorumUnavailable

__all__ = ["ACQUIRE", "EXTEND", "OWNER", "RELEASE", "Redlock"]

logger = logging.getLogger(__name__)

ACQUIRE = """
-- KEYS[1]: the lock
-- ARGV[1]: the token; ARGV[2]: the TTL in ms; ARGV[3]: the uptime in seconds this
--   node needs before it may vote (0: no such rule)
-- Returns: 1 = granted; 0 = held by another token; -1 = abstains, the node started
--   less than a TTL ago and may have lost a grant it made before a restart
-- On Redis 6.x with lua-replicate-commands off, a write after INFO (whose answer a
-- replica would not share) is refused unless the script's effects are replicated.
redis.replicate_commands()
local need = tonumber(ARGV[3])
if need > 0 then
  local up = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)'))
  if up < need then return -1 end
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

RELEASE = """
-- KEYS[1]: the lock
-- ARGV[1]: the token
-- Returns: 1 if this token held the lock here and it is now deleted, else 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

EXTEND = """
-- KEYS[1]: the lock
-- ARGV[1]: the token; ARGV[2]: the new TTL in ms
-- Returns: 1 if this token holds the lock here and its TTL is now ARGV[2], else 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

OWNER = """
-- KEYS[1]: the lock
-- ARGV: none
-- Returns: the token holding the lock on this node, or nil
return redis.call('GET', KEYS[1])
"""

_ACQUIRE, _RELEASE, _EXTEND, _OWNER = (
    Script(ACQUIRE),
    Script(RELEASE),
    Script(EXTEND),
    Script(OWNER),
)

# Errors that count a node as not answering; anything else is a bug and propagates.
_NODE_ERRORS = (RedisError, OSError, TimeoutError)


def _as_bytes(value: Any) -> Any:
    """A reply as bytes when it is text (clients with ``decode_responses=True``)."""
    return value.encode() if isinstance(value, str) else value


def _describe(client: Redis) -> str:
    """``host:port`` (or the socket path) of a client, for error messages."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return str(kwargs["path"])
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


class Redlock:
    """A lock held on a majority of N independent Redis servers (the Redlock algorithm).

    ``clients`` are one :class:`redis.asyncio.Redis` per node, owned by the caller
    (this object never closes them). ``timeout`` is the TTL in seconds (required:
    a Redlock without expiry would need every node to survive). The other
    arguments mean what they mean for :class:`dedup.lock.Lock`, plus:

    * ``node_timeout_s``: how long one node may take to answer, far below the TTL
      so that a dead node cannot eat the validity (default ``ttl / 100``, clamped
      to 20-500 ms);
    * ``drift_factor``: the clock drift allowed, as a fraction of the TTL (plus 2 ms);
    * ``restart_guard``: a node up for less than a TTL does not vote. Turn it off
      only if every node persists each write (``appendfsync always``).

    ``validity_s`` is the time left on the grant by the local monotonic clock;
    work that must finish under the lock must finish within it. Blocking acquire
    retries after random delays of up to ``sleep``; it raises
    :class:`~dedup.errors.QuorumUnavailable` as soon as fewer than a quorum of
    nodes answer, rather than waiting for nodes that are down.
    """

    def __init__(
        self,
        clients: Sequence[Redis],
        name: str | bytes,
        timeout: float = 10.0,
        *,
        sleep: float = 0.2,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        node_timeout_s: float | None = None,
        drift_factor: float = 0.01,
        restart_guard: bool = True,
        raise_on_release_error: bool = True,
    ) -> None:
        if not clients:
            raise ConfigError("Redlock needs at least one Redis client")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ConfigError("Redlock needs a positive timeout (the TTL of each grant)")
        if not (drift_factor >= 0 and math.isfinite(drift_factor)):
            raise ConfigError("drift_factor must be a finite number >= 0")
        if node_timeout_s is not None and not (
            node_timeout_s > 0 and math.isfinite(node_timeout_s)
        ):
            raise ConfigError("node_timeout_s must be a positive finite number")
        self.clients = list(clients)
        self.name = name
        self.timeout = float(timeout)
        self.sleep = sleep
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.node_timeout_s = (
            node_timeout_s if node_timeout_s is not None else min(max(timeout / 100, 0.02), 0.5)
        )
        self.drift_s = timeout * drift_factor + 0.002
        self.restart_guard = restart_guard
        self.raise_on_release_error = raise_on_release_error
        self.quorum = len(self.clients) // 2 + 1
        # The token belongs to this object (as for dedup.lock.Lock), under the same
        # attribute redis-py's Lock uses.
        self.local = SimpleNamespace(token=None)
        self._key = name.encode() if isinstance(name, str) else bytes(name)
        self._valid_until: float | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ state
    @property
    def token(self) -> bytes | None:
        """The token of the current grant, or None when not held."""
        token: bytes | None = self.local.token
        return token

    @property
    def validity_s(self) -> float:
        """Seconds left on the current grant by the local monotonic clock (0 when not held)."""
        if self._valid_until is None or self.local.token is None:
            return 0.0
        return max(0.0, self._valid_until - time.monotonic())

    def _lock_name(self) -> str:
        return self._key.decode(errors="replace")

    # ---------------------------------------------------------------- helpers
    async def _call(
        self, client: Redis, script: Script, args: Sequence[Any]
    ) -> Any | BaseException:
        """One node's answer, or the error it gave (a timeout included)."""
        try:
            # Batched with the other lock calls of this turn of the loop on that node.
            result = await asyncio.wait_for(
                call_script(client, script, [self._key], args), timeout=self.node_timeout_s
            )
        except _NODE_ERRORS as exc:
            return exc
        return result

    async def _all(self, script: Script, args: Sequence[Any]) -> list[Any | BaseException]:
        return await asyncio.gather(*(self._call(c, script, args) for c in self.clients))

    async def _release_all(self, token: bytes) -> int:
        """Delete the lock on every node where ``token`` holds it; how many did."""
        results = await self._all(_RELEASE, [token])
        return sum(1 for r in results if r == 1)

    def _release_in_background(self, token: bytes) -> None:
        """Undo an attempt whose caller went away (cancelled): without this, the nodes
        that granted it would keep the lock for a whole TTL."""
        task = asyncio.ensure_future(self._release_all(token))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---------------------------------------------------------------- acquire
    async def _attempt(self, token: bytes) -> bool:
        ttl_ms = math.ceil(self.timeout * 1000)
        need_uptime_s = math.ceil(self.timeout) if self.restart_guard else 0
        start = time.monotonic()
        try:
            results = await self._all(_ACQUIRE, [token, ttl_ms, need_uptime_s])
        except BaseException:
            self._release_in_background(token)
            raise
        granted = sum(1 for r in results if r == 1)
        validity = self.timeout - (time.monotonic() - start) - self.drift_s
        if granted >= self.quorum and validity > 0:
            self.local.token = token
            self._valid_until = start + self.timeout - self.drift_s
            return True
        # Undo on every node, not only those that said yes: a node whose answer
        # timed out may still have set the key.
        try:
            await self._release_all(token)
        except BaseException:
            self._release_in_background(token)
            raise
        errors = {
            _describe(c): f"{type(r).__name__}: {r}"
            for c, r in zip(self.clients, results, strict=True)
            if isinstance(r, BaseException)
        }
        answered = len(self.clients) - len(errors)
        if answered < self.quorum:
            detail = "; ".join(f"{node}: {err}" for node, err in errors.items())
            raise QuorumUnavailable(
                f"Redlock {self._lock_name()!r}: only {answered} of {len(self.clients)} nodes "
                f"answered, {self.quorum} needed ({detail})",
                lock_name=self._lock_name(),
                quorum=self.quorum,
                answered=answered,
                errors=errors,
            )
        return False

    async def acquire(
        self,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """Try to take the lock on a quorum of nodes; True once held.

        Same arguments as :meth:`dedup.lock.Lock.acquire`. Raises
        :class:`~dedup.errors.QuorumUnavailable` when fewer nodes than the quorum
        answer an attempt.
        """
        if blocking is None:
            blocking = self.blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout
        if token is None:
            raw = secrets.token_hex(16).encode()
        else:
            raw = token.encode() if isinstance(token, str) else bytes(token)
        deadline = None if blocking_timeout is None else time.monotonic() + blocking_timeout
        while True:
            if await self._attempt(raw):
                return True
            if not blocking:
                return False
            # A random delay, so that clients that collided do not collide again.
            delay = random.uniform(0, self.sleep)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                delay = min(delay, left)
            await asyncio.sleep(delay)

    # ----------------------------------------------------------------- others
    async def release(self) -> None:
        """Release the lock on every node.

        Raises :class:`~dedup.errors.LockError` when not held, and
        :class:`~dedup.errors.LockNotOwned` when fewer than a quorum of nodes still
        held this token (the grant had expired, or nodes failed meanwhile).
        """
        token = self.local.token
        if token is None:
            raise LockError(
                "Cannot release a lock that's not owned or is already unlocked.",
                lock_name=self._lock_name(),
            )
        try:
            released = await self._release_all(token)
        except BaseException:
            self._release_in_background(token)
            raise
        finally:
            self.local.token = None
            self._valid_until = None
        if released < self.quorum:
            raise LockNotOwned(
                f"Redlock {self._lock_name()!r} was held on only {released} of "
                f"{len(self.clients)} nodes at release ({self.quorum} needed)",
                lock_name=self._lock_name(),
            )

    async def extend(self, ttl_s: float | None = None) -> Literal[True]:
        """Reset the TTL to ``ttl_s`` (default: the lock's ``timeout``) on a quorum of nodes.

        On success the validity starts again from now. If fewer than a quorum of
        nodes still hold this token, or the extension took longer than its own
        validity, the lock is lost: it is released everywhere and
        :class:`~dedup.errors.LockNotOwned` is raised.

        With ``restart_guard``, ``ttl_s`` may not exceed ``timeout`` (a
        :class:`~dedup.errors.ConfigError` otherwise, the lock kept as it was): a node
        votes again once up for ``timeout``, so a longer grant could outlive the
        guard's wait on a node that restarted without it and be granted twice.
        """
        token = self.local.token
        if token is None:
            raise LockError("Cannot extend an unlocked lock", lock_name=self._lock_name())
        ttl = self.timeout if ttl_s is None else float(ttl_s)
        if self.restart_guard and ttl > self.timeout:
            raise ConfigError(
                f"with restart_guard, an extension may not exceed the timeout ({self.timeout} "
                f"s) that a restarted node waits before it votes: make the Redlock's timeout "
                f"at least {ttl} s instead"
            )
        start = time.monotonic()
        results = await self._all(_EXTEND, [token, math.ceil(ttl * 1000)])
        extended = sum(1 for r in results if r == 1)
        validity = ttl - (time.monotonic() - start) - self.drift_s
        if extended >= self.quorum and validity > 0:
            self._valid_until = start + ttl - self.drift_s
            return True
        self.local.token = None
        self._valid_until = None
        await self._release_all(token)
        raise LockNotOwned(
            f"Redlock {self._lock_name()!r} extended on only {extended} of "
            f"{len(self.clients)} nodes ({self.quorum} needed): the lock is lost",
            lock_name=self._lock_name(),
        )

    async def owned(self) -> bool:
        """True if this object's token holds the lock on a quorum and validity is left."""
        token = self.local.token
        if token is None or self.validity_s <= 0:
            return False
        results = await self._all(_OWNER, [])
        return sum(1 for r in results if _as_bytes(r) == token) >= self.quorum

    async def locked(self) -> bool:
        """True if some token (anyone's) holds the lock on a quorum of nodes."""
        results = await self._all(_OWNER, [])
        holders: dict[bytes, int] = {}
        for r in map(_as_bytes, results):
            if isinstance(r, bytes):
                holders[r] = holders.get(r, 0) + 1
        return any(n >= self.quorum for n in holders.values())

    async def __aenter__(self) -> Self:
        if await self.acquire():
            return self
        raise LockError(
            "Unable to acquire lock within the time specified", lock_name=self._lock_name()
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except LockError:
            if self.raise_on_release_error:
                raise
            logger.warning("Redlock %r was no longer held when leaving its block", self.name)
