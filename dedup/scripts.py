"""The server-side steps of the claim protocol, as Lua, and how they are called.

Each script runs atomically on the server, so "already saved?" and "take the
lease" are one step, and so are "mark saved" and "drop the lease"; done as
separate commands they leave a window in which a second writer slips through.

Key states: absent -> leased (value: the claimant's token, with a PX expiry)
-> saved (value: ``"1"``, no expiry unless a retention is set). Tokens are never
``"1"``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

__all__ = ["ABORT", "CLAIM", "COMMIT", "SAVED_MARKER", "Script"]

SAVED_MARKER = b"1"

CLAIM = """
-- KEYS: the keys of one batch, each at most once
-- ARGV[1]: the claimant's token; ARGV[2]: the lease in milliseconds
-- Returns: one letter per key, in order: S = already saved,
--   W = won (lease set, or extended because the token is already ours),
--   B = busy (another claimant's lease)
local token, lease = ARGV[1], ARGV[2]
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if not v then
    redis.call('SET', key, token, 'PX', lease)
    out[i] = 'W'
  elseif v == '1' then
    out[i] = 'S'
  elseif v == token then
    redis.call('PEXPIRE', key, lease)
    out[i] = 'W'
  else
    out[i] = 'B'
  end
end
return table.concat(out)
"""

COMMIT = """
-- KEYS: keys whose rows are committed in the database
-- ARGV[1]: the committer's token; ARGV[2]: retention of the saved marker in ms, 0 = none
-- Returns: how many of the keys still held the committer's lease
-- The row is durable, so the key becomes "saved" whoever holds it now: a lost
-- lease is not an error, and marking it saved only spares the next claimant a
-- redundant insert.
local token, keep = ARGV[1], tonumber(ARGV[2])
local held = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == token then held = held + 1 end
  if keep > 0 then
    redis.call('SET', key, '1', 'PX', keep)
  else
    redis.call('SET', key, '1')
  end
end
return held
"""

ABORT = """
-- KEYS: keys whose write failed
-- ARGV[1]: the claimant's token
-- Returns: how many leases were released (only those still holding the token)
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    n = n + 1
  end
end
return n
"""


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
