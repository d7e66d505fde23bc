"""The Redis backend's scripts on a blob's keys and on controller state (RedisBlobStore registers them). Each runs
without interleaving: a check and its write are one step. The large put's scripts are in fleet/cas/redis_pieces.py, the
named references' in redis_holders.py, GC's in redis_gc.py."""

from __future__ import annotations

from fleet.cas.redis_pieces import IN_FLIGHT_LUA, LEASE_LUA

# KEYS: data, meta, byte count, in flight; ARGV: data, size, now, lease, verdict, quota, charge, ref.
# 1: stored; 0: stored already (lease extended); {used, in flight}: over quota (pieced puts in flight count)
# A blob whose metadata stayed and whose bytes went (evicted, deleted behind the store's back) gets its bytes back under
# that metadata (pins, verdict, charge, counted already). NOTE: the metadata alone meant "stored": the re-put of such a
# blob "succeeded" and it stayed unreadable (NOT_FOUND) for good.
PUT_LUA = LEASE_LUA + IN_FLIGHT_LUA + """
if redis.call('EXISTS', KEYS[2]) == 1 then
  if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[1], ARGV[1]) end
  extend_lease(KEYS[2], ARGV[4])
  return 0
end
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local quota = tonumber(ARGV[6])
if quota > 0 then
  local flying = in_flight(KEYS[4], ARGV[8])
  if used + flying + tonumber(ARGV[7]) > quota then return {used, flying} end
end
redis.call('INCRBY', KEYS[3], ARGV[7])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'size', ARGV[2], 'charge', ARGV[7], 'created', ARGV[3], 'pins', '0', 'refs', '0',
           'verdict', ARGV[5], 'reasons', '[]', 'lease_expires', ARGV[4])
return 1
"""

# KEYS: meta, data. 1: both there (lease extended): a put's dedup check; 0: put it (PUT_LUA)
TOUCH_LUA = LEASE_LUA + """
if redis.call('EXISTS', KEYS[1], KEYS[2]) < 2 then return 0 end
extend_lease(KEYS[1], ARGV[1])
return 1
"""

# KEYS: meta; ARGV: counter, delta. The metadata after the change (HGETALL's pairs); -1: refused below 0; nil: missing.
# NOTE: answered from the change itself: a stat() after it could find the blob collected meanwhile (BlobRefs.unpin,
# fleet/cas/store_refs.py).
INCR_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local v = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) + tonumber(ARGV[2])
if v < 0 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], v)
return redis.call('HGETALL', KEYS[1])
"""

VERDICT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'verdict', ARGV[1], 'reasons', ARGV[2])
return 1
"""

# KEYS[1]: a kv namespace's hash; ARGV: key, '1' + old value or '0' (absent), '1' + new value or '0' (delete).
KV_SWAP_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '0' then
  if cur then return 0 end
elseif cur ~= string.sub(ARGV[2], 2) then
  return 0
end
if ARGV[3] == '0' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], string.sub(ARGV[3], 2)) end
return 1
"""

# KEYS[1]: a kv namespace's hash; ARGV: key, value, max keys. 1: written; 0: a new key and the hash holds max keys already
KV_PUT_BOUNDED_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
