"""The Lua of shared writes: the fleet's heartbeat and writer election, the bounded queue
(push, pop and hold), and the lease moves between a claimant and the writer (renew,
unhold, take back), each one atomic step on the server.
"""

from __future__ import annotations

__all__ = ["END_TERM", "ENQUEUE", "HEARTBEAT", "LEAVE", "POP", "RENEW", "TAKE_BACK", "UNHOLD"]

HEARTBEAT = """
-- KEYS[1]: the set of live gateways (score: expiry in ms of the server's clock)
-- ARGV[1]: this gateway's id; ARGV[2]: how long its heartbeat counts, in ms;
--   ARGV[3]: the channel every gateway of the sink hears
-- Returns: how many gateways are alive, this one included
-- A gateway new to the set says so: the others count again at once, rather than at
-- their next beat, so that a fleet of one that gains a second gateway shares its
-- writes from then on.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if redis.call('ZADD', KEYS[1], now + ttl, ARGV[1]) == 1 then
  redis.call('PUBLISH', ARGV[3], 'joined')
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return redis.call('ZCARD', KEYS[1])
"""

LEAVE = """
-- KEYS[1]: the set of live gateways; ARGV[1]: this gateway's id
-- Returns: 1 if it was there
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

ENQUEUE = """
-- KEYS[1]: the write queue; KEYS[2]: the writer's term (set while a writer pops);
--   KEYS[2+i]: the lease key of row i
-- ARGV[1]: the most rows the queue may hold; ARGV[2]: its expiry in ms; ARGV[3]: the
--   claimant's token; ARGV[4]: the lease in ms; ARGV[3+2i]: row i's queued token (the
--   claimant's token, '#', the claim's nonce); ARGV[4+2i]: row i
-- Returns: {1 when the rows fit under the cap, 0 when not (none queued), the writer's
--   term or false, one character per row: 1 queued, 0 not (its lease is no longer the
--   claimant's)}
-- A queued row's lease holds its queued token: only a writer that finds it there may
-- write the row, and only a claimant that finds it there may take the row back.
local n = #KEYS - 2
local term = redis.call('GET', KEYS[2])
if redis.call('LLEN', KEYS[1]) + n > tonumber(ARGV[1]) then return {0, term, ''} end
local token, lease, rows, out = ARGV[3], ARGV[4], {}, {}
for i = 1, n do
  local key = KEYS[2 + i]
  if redis.call('GET', key) == token then
    redis.call('SET', key, ARGV[3 + 2 * i], 'PX', lease)
    rows[#rows + 1] = ARGV[4 + 2 * i]
    out[i] = '1'
  else
    out[i] = '0'
  end
end
for i = 1, #rows, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(rows, i, math.min(i + 999, #rows)))
end
if #rows > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return {1, term, table.concat(out)}
"""

POP = """
-- KEYS[1]: the write queue; KEYS[2]: the writer's term; KEYS[3]: the writer's last pop
--   (a list: its id, its flags, its rows)
-- ARGV[1]: the most rows to take; ARGV[2]: this writer's term; ARGV[3]: its expiry in ms;
--   ARGV[4]: the lease in ms; ARGV[5]: the namespace's key prefix; ARGV[6]: this pop's
--   id (new for every pop of the writer; the same when the pop is sent again);
--   ARGV[7...]: rows taken off the queue before (by a blocking pop), to hold too
-- Returns: {up to ARGV[1] rows from the queue's head, taken off it; one character per
--   row, those of ARGV[7...] first: 1 when the lease its prefix names held its queued
--   token (it now holds the queued token, '@', the term, for a lease, so that the
--   statement ends inside it and its claimant cannot take it back), 0 when not
--   (no readable prefix, a key outside the namespace, or a lease taken back, expired,
--   another claimant's or saved)}
-- A writer names its term at every pop: claimants wait for it while the term lasts.
-- The rows are taken off before any is read, so no row can wedge the queue's head.
-- A pop sent again because its answer was lost (the connection dropped after the
-- server ran it) returns that answer again from KEYS[3], taking and holding nothing
-- more: taken again, its rows would be held by this term and answered by no one until
-- their holds expired. The next pop (another id) drops the copy; it also expires with
-- the term.
-- (pcall: a key of another type is no copy, and the DEL below replaces it.)
local last = redis.pcall('LRANGE', KEYS[3], 0, 1)
if last[1] == ARGV[6] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return {redis.call('LRANGE', KEYS[3], 2, -1), last[2]}
end
redis.call('DEL', KEYS[3])
local term, lease, prefix = ARGV[2], ARGV[4], ARGV[5]
redis.call('SET', KEYS[2], term, 'PX', ARGV[3])
-- A count of 0 takes nothing (LRANGE 0 -1 would take the whole queue): a writer of one
-- row a statement holds the row its blocking pop took, and pops no more.
local rows = {}
if tonumber(ARGV[1]) > 0 then
  rows = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
  if #rows > 0 then redis.call('LTRIM', KEYS[1], #rows, -1) end
end
-- A row: <key length, 2 bytes big-endian><lease key><queued token>|<signed message>
local function hold(row)
  local hi, lo = string.byte(row, 1, 2)
  if not lo then return '0' end
  local n = hi * 256 + lo
  local key = string.sub(row, 3, 2 + n)
  local bar = string.find(row, '|', 3 + n, true)
  if n == 0 or not bar or string.sub(key, 1, #prefix) ~= prefix then return '0' end
  local queued = string.sub(row, 3 + n, bar - 1)
  -- pcall: a key of another type (a forged prefix) is simply not a lease.
  if queued == '' or redis.pcall('GET', key) ~= queued then return '0' end
  redis.call('SET', key, queued .. '@' .. term, 'PX', lease)
  return '1'
end
local out = {}
for i = 7, #ARGV do out[#out + 1] = hold(ARGV[i]) end
for i = 1, #rows do out[#out + 1] = hold(rows[i]) end
local flags = table.concat(out)
if #out > 0 then
  redis.call('RPUSH', KEYS[3], ARGV[6], flags)
  for i = 1, #rows, 1000 do
    redis.call('RPUSH', KEYS[3], unpack(rows, i, math.min(i + 999, #rows)))
  end
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
return {rows, flags}
"""

END_TERM = """
-- KEYS[1]: the writer's term; KEYS[2]: this term's copy of its last pop
-- ARGV[1]: the term that ends; ARGV[2]: the channel every gateway of the sink hears
-- Returns: 1 if the term was still the current one (now none is, and the gateways are
--   told so)
-- A writer that stops ends its term at once, and says so: claimants waiting for it take
-- their rows back, and candidates stand, at once instead of at their next renewal or
-- try (or, for the term's key, a writer lease later).
redis.call('DEL', KEYS[2])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'ended')
  return 1
end
return 0
"""

RENEW = """
-- KEYS[1]: the writer's term; KEYS[1+i]: the lease key of a row a claimant queued and
--   still waits for
-- ARGV[1]: the lease in ms; ARGV[1+i]: row i's queued token
-- Returns: the writer's term or false (each lease still holding its queued token is
--   renewed; one a writer holds is the writer's to renew)
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i] then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
  end
end
return redis.call('GET', KEYS[1])
"""

TAKE_BACK = """
-- KEYS[1]: the writer's term; KEYS[1+i]: the lease key of a row the claimant queued
-- ARGV[1]: the claimant's token; ARGV[2]: the lease in ms; ARGV[2+i]: row i's queued token
-- Returns: {one letter per row, the writer's term or false}:
--   o = taken back: the lease is the claimant's again (renewed), no writer will write it;
--   h = a writer of the current term holds it (its word comes);
--   d = a writer of an ended term holds it (its lease expires unless it answers);
--   x = the lease is gone (saved, expired, or another's)
local term = redis.call('GET', KEYS[1])
local out = {}
for i = 2, #KEYS do
  local v, queued = redis.call('GET', KEYS[i]), ARGV[1 + i]
  if v == queued then
    redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
    out[i - 1] = 'o'
  elseif v and string.sub(v, 1, #queued + 1) == queued .. '@' then
    out[i - 1] = (term and string.sub(v, #queued + 2) == term) and 'h' or 'd'
  else
    out[i - 1] = 'x'
  end
end
return {table.concat(out), term}
"""

UNHOLD = """
-- KEYS: the lease keys of rows a writer held and could not write
-- ARGV[1]: the lease in ms; ARGV[2]: the writer's term; ARGV[2+i]: row i's queued token
-- Returns: how many were still held by this term (each now queued again, for its
--   claimant to take back)
local n = 0
for i, key in ipairs(KEYS) do
  local queued = ARGV[2 + i]
  if redis.call('GET', key) == queued .. '@' .. ARGV[2] then
    redis.call('SET', key, queued, 'PX', ARGV[1])
    n = n + 1
  end
end
return n
"""
