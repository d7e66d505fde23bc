"""Redis GC: every blob's metadata key found by SCAN, the blobs judged and deleted by one script call a batch."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# KEYS: (data, metadata, byte count) of each blob in turn; ARGV[1]: now. Returns how many it deleted.
# Each blob is judged on its own as before (a damaged one is skipped, never deleted blind); one call
# takes a batch of blobs (_GC_BATCH) instead of one round trip each.
GC_MANY_LUA = """
local now, deleted = tonumber(ARGV[1]), 0
for i = 1, #KEYS, 3 do
  local m = KEYS[i + 1]
  if redis.call('TYPE', m)['ok'] == 'hash' then
    local f = redis.call('HMGET', m, 'pins', 'refs', 'lease_expires', 'charge', 'size')
    local pins, refs, lease = tonumber(f[1]), tonumber(f[2]), tonumber(f[3])
    -- unreadable metadata (a field missing or not a number): never collected
    if pins ~= nil and refs ~= nil and lease ~= nil and pins == 0 and refs == 0 and lease <= now then
      local charge = tonumber(f[4]) or tonumber(f[5]) or 0  -- no charge: stored before charges, counted its size
      redis.call('DEL', KEYS[i], m)
      if redis.call('DECRBY', KEYS[i + 2], charge) <= 0 then redis.call('DEL', KEYS[i + 2]) end
      deleted = deleted + 1
    end
  end
end
return deleted
"""

# Blobs judged per GC script call. A call that deletes all 128 holds Redis about 1 ms (less when it
# keeps them); one call per blob cost a round trip (and, under appendfsync always, a write) each:
# 20,000 expired blobs took 10.6 s that way, 0.4 s in batches of 128.
_GC_BATCH = 128

# A blob's metadata key, exactly: tenants exclude ':' and a ref is 64 lowercase hex.
_META_KEY = re.compile(r"kvf:t:([A-Za-z0-9_.-]{1,64}):m:([0-9a-f]{64})")


class RedisGc:
    """GC's scan and script, on a redis-py client (`r`)."""

    def __init__(self, r: Any) -> None:
        self.r, self._s_gc = r, r.register_script(GC_MANY_LUA)

    def collect(self, now: float, put_keys: Callable[[str, str], list[str]]) -> int:
        """Collect blob by blob, _GC_BATCH blobs a script call; a key that only looks like metadata (the
        op log of a session named `x:m:y` matches the scan pattern too), or metadata that is not a hash
        of numbers, is skipped and kept, so no key can abort GC for every tenant. `put_keys(tenant, ref)`:
        the blob's data, metadata and byte-count keys (RedisBlobStore._put_keys)."""
        deleted, batch = 0, []
        for key in self.r.scan_iter(match="kvf:t:*:m:*", count=1000):
            m = _META_KEY.fullmatch(key.decode("utf-8", "replace"))
            if m is not None:
                batch += put_keys(*m.groups())
            if len(batch) >= 3 * _GC_BATCH:
                deleted += int(self._s_gc(keys=batch, args=[repr(now)]))
                batch = []
        if batch:
            deleted += int(self._s_gc(keys=batch, args=[repr(now)]))
        return deleted
