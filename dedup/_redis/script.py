"""Running Lua on Redis: scripts called by SHA, and their variants per server version.

:class:`Script` calls a script by SHA and loads it again on NOSCRIPT. A script's source
may call three helpers (``lease_or_get``, ``set_get``, ``getdel``) for the steps whose
best command depends on the server's version; :func:`render` makes it runnable for a
:class:`ScriptVariant`: :data:`REDIS_7` writes its one command in place of each call
(``SET ... NX GET``, ``SET ... GET``, ``GETDEL``: a Lua function call per key would cost
~5 % of the script time), :data:`REDIS_6` defines them as local functions with the commands
Redis 6.0 has (a ``GET`` then a ``SET``, a ``GET`` then a ``DEL``; inside a script the pair
is just as atomic). :func:`cross_slot` gives a script's Redis Cluster form.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

from dedup._redis.mux import Mux
from dedup._redis.packing import pack

__all__ = [
    "REDIS_6",
    "REDIS_7",
    "VARIANTS",
    "Script",
    "ScriptCall",
    "ScriptVariant",
    "cross_slot",
    "exchange",
    "render",
    "run_script",
    "run_together",
]


# Redis 7.0+: each helper call of the sources, and the one command written in its place
# (module strings, like the scripts: `dedup bench` reads the commands scripts run from them).
_LEASE_OR_GET_7 = "redis.call('SET', key, token, 'NX', 'PX', lease, 'GET')"
_SET_GET_PX_7 = "redis.call('SET', key, '1', 'PX', keep, 'GET')"
_SET_GET_7 = "redis.call('SET', key, '1', 'GET')"
_GETDEL_7 = "redis.call('GETDEL', key)"
_INLINE_7 = (
    ("lease_or_get(key, token, lease)", _LEASE_OR_GET_7),
    ("set_get(key, '1', 'PX', keep)", _SET_GET_PX_7),
    ("set_get(key, '1')", _SET_GET_7),
    ("getdel(key)", _GETDEL_7),
)
_HELPER_CALL = re.compile(r"\b(lease_or_get|set_get|getdel)\(")

_HELPERS_6 = """
-- Redis 6.0+: no SET ... NX GET (7.0), SET ... GET or GETDEL (6.2); a script runs
-- alone on the server, so reading first and writing next is just as atomic.
local function lease_or_get(key, token, lease)
  local v = redis.call('GET', key)
  if not v then redis.call('SET', key, token, 'PX', lease) end
  return v
end
local function set_get(key, ...)
  local old = redis.call('GET', key)
  redis.call('SET', key, ...)
  return old
end
local function getdel(key)
  local v = redis.call('GET', key)
  if v then redis.call('DEL', key) end
  return v
end
"""


@dataclass(frozen=True, slots=True)
class ScriptVariant:
    """Which commands the scripts use, for servers from version ``since`` on."""

    name: str
    since: tuple[int, int]
    commands: str
    helpers: str
    """Lua put before each script: the helpers' definitions ("" when they are inlined)."""
    inline: tuple[tuple[str, str], ...]
    """Helper calls replaced by a command, as (call, command) pairs."""
    cross_slot_flag: bool
    """Redis 7 refuses undeclared keys of several slots in one script unless the script
    says ``allow-cross-slot-keys`` (a ``#!lua`` line Redis 6 cannot parse); Redis 6 runs
    any key its node serves."""


REDIS_7 = ScriptVariant(
    "redis7", (7, 0), "SET NX PX GET, GETDEL", "", _INLINE_7, cross_slot_flag=True
)
"""Redis 7.0 and later, and Valkey 7.2 and later: one command per step."""
REDIS_6 = ScriptVariant(
    "redis6", (6, 0), "GET then SET, GET then DEL", _HELPERS_6, (), cross_slot_flag=False
)
"""Redis 6.0 to 6.2: a read and a write where Redis 7 has one command."""
VARIANTS = (REDIS_7, REDIS_6)
"""Every variant, newest first."""


def render(source: str, variant: ScriptVariant) -> str:
    """The runnable script of ``source`` (one of this module's constants) for ``variant``:
    its helper calls replaced by commands, or the helpers defined in front."""
    for call, command in variant.inline:
        source = source.replace(call, command)
    if not variant.helpers and _HELPER_CALL.search(source):
        raise ValueError(f"{variant.name}: a helper call with no command to replace it")
    return variant.helpers + source


_CROSS_SLOT_FLAG = "#!lua flags=allow-cross-slot-keys\n"
_CROSS_SLOT = """
-- The cluster form: run on ONE Redis Cluster node for keys of many slots, all served by
-- that node (called with no declared keys). ARGV[1] is how many keys follow it in ARGV;
-- the rest of ARGV is the script's own. Redis refuses a key this node does not serve.
local KEYS, ARGV = (function(a)
  local n, k, v = tonumber(a[1]), {}, {}
  for i = 1, n do k[i] = a[1 + i] end
  for i = n + 2, #a do v[#v + 1] = a[i] end
  return k, v
end)(ARGV)
"""


def cross_slot(source: str, variant: ScriptVariant = REDIS_7) -> str:
    """The cluster form of the runnable script ``source`` (from :func:`render` with
    ``variant``): the same steps, for the keys of many slots on one node, passed after
    their count in ARGV (with Redis 7's ``allow-cross-slot-keys`` flag), so that a batch
    costs one call per node instead of one per slot. Declared KEYS of several slots
    would be refused (CROSSSLOT)."""
    return (_CROSS_SLOT_FLAG if variant.cross_slot_flag else "") + _CROSS_SLOT + source


class Script:
    """A Lua script called by SHA, loaded again when the server answers NOSCRIPT.

    The SHA is computed locally, so the first call needs no extra round trip when
    the script is already cached on the server (as after another process loaded it).
    """

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    async def __call__(
        self, client: Redis | RedisCluster, keys: Sequence[bytes], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """Run the script on ``client``: its result and the round trips it took (1, or 3
        when the server had lost the script and it was loaded again)."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args), 1
        except NoScriptError:
            # A restarted or flushed server lost its script cache: load and retry once.
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args), 3


ScriptCall = tuple[Script, Sequence[bytes], Sequence[Any]]
"""A script with its KEYS and ARGV, for :func:`run_together`."""


async def run_script(
    client: Redis | RedisCluster, script: Script, keys: Sequence[bytes], args: Sequence[Any]
) -> tuple[Any, int]:
    """:meth:`Script.__call__`, on one server through :func:`run_together`'s lean path
    (one packed write on a pooled connection, no redis-py command bookkeeping): the hot
    scripts of the save path, a call per claim batch or writer pop."""
    if isinstance(client, Redis):
        (result,), trips = await run_together(client, [(script, keys, args)])
        return result, trips
    return await script(client, keys, args)


async def run_together(
    client: Redis, calls: Sequence[ScriptCall], before: Sequence[Sequence[Any]] = ()
) -> tuple[list[Any], int]:
    """Run ``calls`` in order in one round trip (a pipeline, not a transaction: each
    script is atomic, another client's command may run between two of them): their
    results and the round trips taken. ``before`` are plain commands (``PUBLISH``, say)
    sent ahead of the scripts in the same round trip; their replies come first. On
    NOSCRIPT the missing scripts are loaded and everything runs again, so each call and
    command must be safe to run twice (the claim protocol's are, per token)."""

    packed = _pack_calls(calls, before)
    count = len(before) + len(calls)

    async def attempt() -> list[Any]:
        if packed is not None:
            return await exchange(client.connection_pool, packed, count)
        async with client.pipeline(transaction=False) as pipe:
            for command in before:
                pipe.execute_command(*command)
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    results = await attempt()
    trips = 1
    missing = {
        script.sha: script
        for (script, _, _), result in zip(calls, results[len(before) :], strict=True)
        if isinstance(result, NoScriptError)
    }
    if missing:
        for script in missing.values():
            await client.script_load(script.source)
        results = await attempt()
        trips += len(missing) + 1
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results, trips


def _pack_calls(calls: Sequence[ScriptCall], before: Sequence[Sequence[Any]] = ()) -> bytes | None:
    """``before``, then the ``EVALSHA`` of every call, as one RESP buffer, or None when an
    argument is not bytes, str or int (:func:`dedup._redis.packing.pack`)."""
    pieces = []
    for command in before:
        piece = pack(tuple(command))
        if piece is None:
            return None
        pieces.append(piece)
    for script, keys, args in calls:
        piece = pack(("EVALSHA", script.sha, len(keys), *keys, *args))
        if piece is None:
            return None
        pieces.append(piece)
    return b"".join(pieces)


async def exchange(
    pool: ConnectionPool, packed: bytes, count: int, *, retry: bool = True
) -> list[Any]:
    """Send ``packed`` (RESP commands) on one connection of ``pool`` and read its
    ``count`` replies in order, an error reply as its exception: what redis-py's
    pipeline does for a batch of scripts, at a fraction of its CPU. A pool of
    :func:`dedup._redis.connect.connect_redis` sends it on its shared connection (its
    ``mux``, :mod:`dedup._redis.mux`); another pool on one of its connections, with no
    command stack and no per-command options or callbacks.

    A connection error sends everything again (``CONNECTION_RETRIES`` times; on another
    pool, as its ``Retry`` says): only for commands safe to run twice; ``retry=False``
    raises it instead (a reply lost after the server ran them leaves their outcome to
    the caller). On a pooled connection any other failure, a cancellation included,
    closes it, so no unread reply is left on it for its next user; the shared connection
    reads and drops such replies. (A connection the server closed meanwhile, a restart
    say, is replaced before the write, so it needs no retry.)
    """
    mux: Mux | None = getattr(pool, "mux", None)
    if mux is not None:
        return await mux.call(packed, count, retries=getattr(pool, "retries", 0) if retry else 0)
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
    try:

        async def once() -> list[Any]:
            await conn.send_packed_command(packed, check_health=False)
            replies: list[Any] = []
            for _ in range(count):
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:  # the reply was read: the stream stays in step
                    replies.append(exc)
            return replies

        async def failed(_: BaseException) -> None:
            await conn.disconnect()

        if not retry:
            return await once()
        return list(await conn.retry.call_with_retry(once, failed))
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    finally:
        await pool.release(conn)
