"""The lock library's Lua: take, release, hand over, extend and read a lock, each one
atomic step on the server (KEYS, ARGV and the return value in each script's header).

Every script runs on Redis 6.0; the fence's ``INCR`` is inside the acquire scripts, so a
grant and its fence cost one round trip.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "ACQUIRE_REENTRANT",
    "EXTEND",
    "HANDOVER",
    "OWNER",
    "REACQUIRE",
    "RELEASE",
    "RELEASE_PLAIN",
]


# Who holds a lock key: the string's value, or the hash's ``owner`` field.
_OWNER_OF = """
local function owner_of(key)
  local kind = redis.call('TYPE', key).ok
  if kind == 'string' then return redis.call('GET', key) end
  if kind == 'hash' then return redis.call('HGET', key, 'owner') end
  return false
end
"""


# The next fence of KEYS[2], at least 1 above the last one while the counter lives:
# one INCR. A missing counter (first grant, expired, or Redis restarted empty) starts
# again from the server time in microseconds, with an expiry of ARGV[3] ms set then
# only, so that INCR alone serves every other grant. Grants of one name come far
# slower than one per microsecond, so a counter stays below the clock and the restart
# value is above every fence before it. '%.0f' because tostring() would write 1.7e+15;
# doubles are exact up to 2^53 (year 2255).
_NEXT_FENCE = """
local fence = redis.call('INCR', KEYS[2])
if fence == 1 then
  local now = redis.call('TIME')
  fence = tonumber(now[1]) * 1000000 + tonumber(now[2])
  redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[3])
end
"""


# Redis 6.x replicates a script as its source unless the server says otherwise
# (lua-replicate-commands no), and then refuses a write after TIME, whose answer a
# replica would not share. Asking for the script's effects to be replicated instead
# works on every 6.x, before the first write; Redis 7 always does so (the call is a
# no-op there). Each script that takes a fence starts with it.
_REPLICATE_EFFECTS = """
redis.replicate_commands()
"""


# A failed attempt of a waiter leaves a flag (KEYS[3]) so that the release that frees
# the lock knows to publish; the release deletes it with the lock in one DEL. A grant
# leaves it too when other waiters of the same client did not try this time
# (ARGV[4] '2'): they wait for the signal of this holder's release.
_FLAG_WAITER = """
if ARGV[4] ~= '0' then redis.call('SET', KEYS[3], '1', 'PX', ARGV[3]) end
"""

ACQUIRE = (
    """
-- KEYS[1]: the lock (a string holding the token); KEYS[2]: its fence counter;
--   KEYS[3]: its "someone waits" flag
-- ARGV[1]: the token; ARGV[2]: the lease in ms, 0 = no expiry;
--   ARGV[3]: how long the fence counter (and a waiter flag) live, in ms;
--   ARGV[4]: '1' = the caller will wait for a release if the lock is held, '2' = and
--   others wait, flag even a grant, '0' = nobody waits
-- Returns: {1, fence} when the lock was free and is now held by the token;
--   {0, pttl} when it is held (pttl -1: the holder's lease has no expiry)
"""
    + _REPLICATE_EFFECTS
    + """
local ok
if ARGV[2] == '0' then
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX')
else
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
end
if not ok then
"""
    + _FLAG_WAITER
    + """
  return {0, redis.call('PTTL', KEYS[1])}
end
if ARGV[4] == '2' then
"""
    + _FLAG_WAITER
    + """
end
"""
    + _NEXT_FENCE
    + """
return {1, fence}
"""
)

ACQUIRE_REENTRANT = (
    """
-- KEYS[1]: the lock (a hash: owner, count, fence); KEYS[2]: its fence counter;
--   KEYS[3]: its "someone waits" flag
-- ARGV[1]: the owner (one token per task); ARGV[2]: the lease in ms, 0 = no expiry;
--   ARGV[3]: how long the fence counter (and a waiter flag) live, in ms;
--   ARGV[4]: '1' = the caller will wait for a release if the lock is held, '2' = and
--   others wait, flag even a new grant, '0' = nobody waits
-- Returns: {1, fence, count} when the owner holds it now (count 1: a new grant, the
--   fence is new; count > 1: a re-entry, the fence is the grant's);
--   {0, pttl, 0} when another owner holds it (pttl -1: no expiry)
"""
    + _REPLICATE_EFFECTS
    + """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'hash' and redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  local n = redis.call('HINCRBY', KEYS[1], 'count', 1)
  -- A re-entry never shortens the lease, nor gives an endless hold an expiry.
  local left = redis.call('PTTL', KEYS[1])
  if ARGV[2] ~= '0' and left >= 0 and left < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return {1, tonumber(redis.call('HGET', KEYS[1], 'fence')), n}
end
if kind ~= 'none' then
"""
    + _FLAG_WAITER
    + """
  return {0, redis.call('PTTL', KEYS[1]), 0}
end
if ARGV[4] == '2' then
"""
    + _FLAG_WAITER
    + """
end
"""
    + _NEXT_FENCE
    + """
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'count', 1, 'fence', string.format('%.0f', fence))
if ARGV[2] ~= '0' then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return {1, fence, 1}
"""
)

RELEASE_PLAIN = """
-- KEYS[1]: the lock (a string holding the token); KEYS[2]: its "someone waits" flag
-- ARGV[1]: the token; ARGV[2]: the release channel
-- Returns: -1 when the token does not hold the lock; 0 when the lock is free now
--   (and, if a waiter flagged itself, its name is published on ARGV[2])
-- pcall: a reentrant lock's hash under this name is simply not ours.
if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('DEL', KEYS[1], KEYS[2]) > 1 then redis.call('PUBLISH', ARGV[2], KEYS[1]) end
return 0
"""

RELEASE = """
-- KEYS[1]: the lock (string or reentrant hash); KEYS[2]: its "someone waits" flag
-- ARGV[1]: the token; ARGV[2]: the release channel
-- Returns: -1 when the token does not hold the lock; otherwise the holds left:
--   0 = the lock is free now (deleted, and, if a waiter flagged itself, its name
--   published on ARGV[2]), n > 0 = a reentrant owner still holds it n times
local kind = redis.call('TYPE', KEYS[1]).ok
local left = 0
if kind == 'string' then
  if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
elseif kind == 'hash' then
  if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return -1 end
  left = redis.call('HINCRBY', KEYS[1], 'count', -1)
else
  return -1
end
if left > 0 then return left end
if redis.call('DEL', KEYS[1], KEYS[2]) > 1 then redis.call('PUBLISH', ARGV[2], KEYS[1]) end
return 0
"""

HANDOVER = (
    """
-- KEYS[1]: the lock (a string holding the token); KEYS[2]: its fence counter;
--   KEYS[3]: its "someone waits" flag
-- ARGV[1]: the holder's token; ARGV[2]: the next holder's token (a waiter of the same
--   client); ARGV[3]: how long the fence counter lives, in ms; ARGV[4]: the next
--   holder's lease in ms, 0 = no expiry; ARGV[5]: '1' = yield instead if a waiter of
--   another client flagged itself; ARGV[6]: the release channel
-- Returns: {1, fence} when the lock is now held by ARGV[2] (a new grant, with a new
--   fence); {0} when it was released instead (published, the flag kept, since the
--   next holder waits too); {-1} when ARGV[1] does not hold the lock
"""
    + _REPLICATE_EFFECTS
    + """
if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then return {-1} end
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[6], KEYS[1])
  return {0}
end
if ARGV[4] == '0' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
end
"""
    + _NEXT_FENCE
    + """
return {1, fence}
"""
)

EXTEND = (
    """
-- KEYS[1]: the lock
-- ARGV[1]: the token; ARGV[2]: milliseconds; ARGV[3]: '1' = the TTL becomes ARGV[2],
--   '0' = ARGV[2] is added to the TTL left
-- Returns: 1 when extended; 0 when the token does not hold the lock or it has no TTL
"""
    + _OWNER_OF
    + """
if owner_of(KEYS[1]) ~= ARGV[1] then return 0 end
local left = redis.call('PTTL', KEYS[1])
if left < 0 then return 0 end
local ttl = tonumber(ARGV[2])
if ARGV[3] == '0' then ttl = ttl + left end
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
"""
)

REACQUIRE = (
    """
-- KEYS[1]: the lock
-- ARGV[1]: the token; ARGV[2]: the lease in ms
-- Returns: 1 when the TTL is reset to ARGV[2]; 0 when the token does not hold the lock
"""
    + _OWNER_OF
    + """
if owner_of(KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

OWNER = (
    """
-- KEYS[1]: the lock
-- ARGV: none
-- Returns: the token holding the lock (string value or hash owner), or nil
"""
    + _OWNER_OF
    + """
return owner_of(KEYS[1])
"""
)
