"""The server-side steps of the claim protocol, as Lua, and how they are called.

Each script runs atomically on the server, so "already saved?" and "take the
lease" are one step, and so are "mark saved" and "drop the lease"; done as
separate commands they leave a window in which a second writer slips through.

A value's lease is always its own key (from :meth:`dedup._claims.keys.KeySpace.key`):
absent -> leased (value: the claimant's token, with a PX expiry). Where "saved" is
recorded depends on the layout:

* ``keys`` (the layout before compact markers; :data:`CLAIM`, :data:`COMMIT`): the lease
  key itself becomes ``"1"`` (no expiry unless a retention is set);
* ``compact`` (the default; :data:`CLAIM_COMPACT`, :data:`COMMIT_COMPACT`): a field of
  a hash bucket (:class:`dedup._claims.keys.MarkerLayout`), and the lease key is deleted;
* approximate (:data:`CLAIM_BLOOM`, :data:`COMMIT_BLOOM`): ``k`` bits of a Bloom
  filter (:class:`dedup._claims.bloom.BloomLayout`), and the lease key is deleted.

The compact and approximate claims also answer "saved" for a ``"1"`` under the lease
key, so markers written in the old layout keep counting. Tokens are never ``"1"``.
:data:`ABORT` and :data:`RECLAIM` serve every layout.

The sources above call three Lua helpers (``lease_or_get``, ``set_get``, ``getdel``)
for the steps whose best command depends on the server's version; :func:`render` makes
them runnable for a :class:`ScriptVariant`: :data:`REDIS_7` writes its one command in
place of each call (``SET ... NX GET``, ``SET ... GET``, ``GETDEL``: a Lua function call
per key would cost ~5 % of the script time), :data:`REDIS_6` defines them as local
functions with the commands Redis 6.0 has (a ``GET`` then a ``SET``, a ``GET`` then a
``DEL``; inside a script the pair is just as atomic).
"""

from __future__ import annotations

__all__ = [
    "ABORT",
    "CLAIM",
    "CLAIM_BLOOM",
    "CLAIM_COMPACT",
    "COMMIT",
    "COMMIT_BLOOM",
    "COMMIT_COMPACT",
    "FORGET",
    "FORGET_RELEASE",
    "RECLAIM",
]


# The lease part of every claim, once "saved?" found no marker: what the key held, and
# a lease set only when it held nothing (lease_or_get: one command on Redis 7).
_LEASE = """
    local key = KEYS[i]
    local v = lease_or_get(key, token, lease)
    if not v then
      out[i] = 'W'
    elseif v == '1' then
      out[i] = 'S'
    elseif v == token then
      redis.call('PEXPIRE', key, lease)
      out[i] = 'W'
    else
      out[i] = 'B'
    end"""

CLAIM = (
    """
-- KEYS: the keys of one batch, each at most once
-- ARGV[1]: the claimant's token; ARGV[2]: the lease in milliseconds
-- Returns: one letter per key, in order: S = already saved,
--   W = won (lease set, or extended because the token is already ours),
--   B = busy (another claimant's lease)
local token, lease = ARGV[1], ARGV[2]
local out = {}
for i = 1, #KEYS do"""
    + _LEASE
    + """
end
return table.concat(out)
"""
)

COMMIT = """
-- KEYS: keys whose rows are committed in the database
-- ARGV[1]: the committer's token; ARGV[2]: retention of the saved marker in ms, 0 = none;
--   ARGV[3]: the lease in milliseconds
-- Returns: how many of the keys still held the committer's lease
-- The row is durable, so the key becomes "saved" whoever holds it now: a lost
-- lease is not an error, and marking it saved only spares the next claimant a
-- redundant insert. The one exception is a forget's hold (a token starting with "F"):
-- the forget deletes the row after this commit, so its hold goes back, with no marker.
local token, keep, lease = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local held = 0
for _, key in ipairs(KEYS) do
  local old
  if keep > 0 then
    old = set_get(key, '1', 'PX', keep)
  else
    old = set_get(key, '1')
  end
  if old == token then
    held = held + 1
  elseif old and string.byte(old, 1) == 70 then
    redis.call('SET', key, old, 'PX', lease)
  end
end
return held
"""

# Where the compact layout keeps a value's marker, from its lease key and its locator
# (see dedup._claims.keys.MarkerLayout.locator): the bucket is named after the key's head, the
# generation and the index in the locator's first 3 bytes; the field is the rest. The
# bucket is not in KEYS, but it carries the lease key's head, hash tag included, so it
# always lives in the lease key's Cluster slot.
_BUCKET = """
local function bucket(key, loc, gen)
  local b1, b2, b3 = string.byte(loc, 1, 3)
  local index = (b1 * 65536 + b2 * 256 + b3) % per_tag
  return string.sub(key, 1, #key - 24) .. 'm' .. gen .. ':' .. index
end
"""

CLAIM_COMPACT = (
    """
-- KEYS: the lease keys of one batch (n, each at most once)
-- ARGV[1]: the claimant's token; ARGV[2]: the lease in milliseconds; ARGV[3]: buckets
--   per hash tag; ARGV[4]: g, the generations read; ARGV[4+j]: their names, newest
--   first; ARGV[4+g+i]: the locator of value i (3 bytes of bucket index, then its field)
-- Returns: one letter per value, in order: S = already saved (its field is in its
--   bucket of one of the generations, or its lease key holds an old-layout "1"),
--   W = won (lease set, or extended because the token is already ours), B = busy
--   (another claimant's lease)
local token, lease, per_tag = ARGV[1], ARGV[2], tonumber(ARGV[3])
local g = tonumber(ARGV[4])
"""
    + _BUCKET
    + """
local out = {}
for i = 1, #KEYS do
  local loc, saved = ARGV[4 + g + i], false
  local field = string.sub(loc, 4)
  for j = 1, g do
    if redis.call('HEXISTS', bucket(KEYS[i], loc, ARGV[4 + j]), field) == 1 then
      saved = true
      break
    end
  end
  if saved then
    out[i] = 'S'
  else"""
    + _LEASE
    + """
  end
end
return table.concat(out)
"""
)

COMMIT_COMPACT = (
    """
-- KEYS: the lease keys whose rows are committed (n)
-- ARGV[1]: the committer's token; ARGV[2]: when the current generation's buckets
--   expire, Unix time in ms, 0 = never; ARGV[3]: buckets per hash tag; ARGV[4]: the
--   current generation's name; ARGV[5]: the lease in milliseconds; ARGV[5+i]: the
--   locator of value i
-- Returns: how many of the lease keys still held the committer's lease
-- The row is durable, so the value becomes "saved" whoever holds the lease now (a lost
-- lease is not an error) and the lease key goes: another claimant's lease, or an
-- old-layout "1", which the field now replaces. The field is set before the lease key
-- goes, so a failure in between leaves a lease that expires, never a gap. A forget's
-- hold (a token starting with "F") is the exception: the forget deletes the row after
-- this commit, so the field is taken back and the hold put back (see COMMIT).
local token, at, per_tag, gen = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local lease = ARGV[5]
"""
    + _BUCKET
    + """
local held = 0
for i, key in ipairs(KEYS) do
  local loc = ARGV[5 + i]
  local b, field = bucket(key, loc, gen), string.sub(loc, 4)
  redis.call('HSET', b, field, '1')
  local cur = getdel(key)
  if cur == token then
    held = held + 1
  elseif cur and string.byte(cur, 1) == 70 then
    redis.call('HDEL', b, field)
    redis.call('SET', key, cur, 'PX', lease)
  end
  if at > 0 and redis.call('PTTL', b) < 0 then
    redis.call('PEXPIREAT', b, at)
  end
end
return held
"""
)

CLAIM_BLOOM = (
    """
-- KEYS: the lease keys of one batch (n, each at most once), then for each value in
--   order its Bloom partition in each of the g generations read, newest first (n*g)
-- ARGV[1]: the claimant's token; ARGV[2]: the lease in milliseconds; ARGV[3]: g;
--   ARGV[4]: k, bits per value; ARGV[4+(i-1)*k+j]: bit offset j of value i
-- Returns: one letter per value, in order: S = probably saved (all its k bits set in
--   one generation; nothing written) or saved in the old layout ("1" under its lease
--   key), W = won (lease set or extended), B = busy (another claimant's lease)
local token, lease = ARGV[1], ARGV[2]
local g, k = tonumber(ARGV[3]), tonumber(ARGV[4])
local n = (#ARGV - 4) / k
local out = {}
for i = 1, n do
  local bits, seen = 4 + (i - 1) * k, false
  for j = 1, g do
    local part = KEYS[n + (i - 1) * g + j]
    seen = true
    for b = 1, k do
      if redis.call('GETBIT', part, ARGV[bits + b]) == 0 then
        seen = false
        break
      end
    end
    if seen then break end
  end
  if seen then
    out[i] = 'S'
  else"""
    + _LEASE
    + """
  end
end
return table.concat(out)
"""
)

COMMIT_BLOOM = """
-- KEYS: the lease keys whose rows are committed (n), then each value's Bloom
--   partition in the current generation (n)
-- ARGV[1]: the committer's token; ARGV[2]: when the current generation's partitions
--   expire, Unix time in ms, 0 = never; ARGV[3]: k; ARGV[4]: bytes of a partition;
--   ARGV[4+(i-1)*k+j]: bit j of value i
-- Returns: how many of the lease keys still held the committer's lease
-- A new partition is created whole, zero-filled: grown bit by bit, Redis would
-- over-allocate it (up to 1 MB more per partition).
local token, at, k, size = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local n = #KEYS / 2
local held = 0
for i = 1, n do
  local key, part = KEYS[i], KEYS[n + i]
  if redis.call('EXISTS', part) == 0 then
    redis.call('SET', part, string.rep('\0', size))
  end
  local bits = 4 + (i - 1) * k
  for b = 1, k do
    redis.call('SETBIT', part, ARGV[bits + b], 1)
  end
  if getdel(key) == token then held = held + 1 end
  if at > 0 and redis.call('PTTL', part) < 0 then
    redis.call('PEXPIREAT', part, at)
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

RECLAIM = """
-- KEYS: lease keys of values a claim answered saved but whose rows are gone (deleted
--   from the database while Redis kept the saved marker)
-- ARGV[1]: the claimant's token; ARGV[2]: the lease in milliseconds
-- Returns: one letter per key, in order: W = won (lease set over nothing or over an
--   old-layout "1", or extended because the token is already ours), B = busy
--   (another claimant's lease)
-- The layout's own markers (compact fields, Bloom bits) are left alone, and not read:
-- a Bloom bit cannot be cleared without clearing other values' bits, and the commit
-- that ends the run writes the marker again anyway. The lease key alone excludes a
-- second runner; the caller reads the row again under the lease, so a row written
-- meanwhile by another runner is found before anything runs.
local token, lease = ARGV[1], ARGV[2]
local out = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local v = redis.call('GET', key)
  if v == token then
    redis.call('PEXPIRE', key, lease)
    out[i] = 'W'
  elseif not v or v == '1' then
    redis.call('SET', key, token, 'PX', lease)
    out[i] = 'W'
  else
    out[i] = 'B'
  end
end
return table.concat(out)
"""

FORGET = (
    """
-- KEYS: the lease keys of values to forget (n, each at most once)
-- ARGV[1]: the forget's token (it starts with "F"); ARGV[2]: its lease in milliseconds;
--   ARGV[3]: buckets per hash tag; ARGV[4]: g, the generations of compact markers to
--   clear (0: the keys layout, whose marker is the lease key itself); ARGV[4+j]: their
--   names; ARGV[4+g+i]: the locator of value i (compact layout only)
-- Returns: one letter per key, in order: W = held by the forget, its markers cleared
--   (a lease set over nothing or over a "1" marker, or extended because the token is
--   the forget's own), B = busy (a save's lease, or another forget's: retry once it ends)
-- While the forget's lease lasts, claims answer busy and commits leave the key alone
-- (COMMIT, COMMIT_COMPACT), so no marker comes back before the row is deleted.
local token, lease, per_tag = ARGV[1], ARGV[2], tonumber(ARGV[3])
local g = tonumber(ARGV[4])
"""
    + _BUCKET
    + """
local out = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local v = redis.call('GET', key)
  if v and v ~= '1' and v ~= token then
    out[i] = 'B'
  else
    redis.call('SET', key, token, 'PX', lease)
    if g > 0 then
      local loc = ARGV[4 + g + i]
      local field = string.sub(loc, 4)
      for j = 1, g do
        redis.call('HDEL', bucket(key, loc, ARGV[4 + j]), field)
      end
    end
    out[i] = 'W'
  end
end
return table.concat(out)
"""
)

FORGET_RELEASE = """
-- KEYS: lease keys a forget held while it deleted their rows
-- ARGV[1]: the forget's token
-- Returns: one letter per key, in order: 1 = released (still the forget's), 0 = lost
--   (its lease ran out and something else happened meanwhile: forget the value again)
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    out[i] = '1'
  else
    out[i] = '0'
  end
end
return table.concat(out)
"""
