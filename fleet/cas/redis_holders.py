"""Named blob references on Redis (BlobStore.add_ref / drop_ref with a holder, held_refs).

    kvf:t:{tenant}:h:{ref}   SET   the blob's holders (each counted once in its metadata's `refs`)
    kvf:holds:{holder}       SET   `{tenant}:{ref}` of each blob the holder holds (tenants exclude ':')

One script takes or gives back a holder's reference: it changes `refs` only when the holder set changed, so a call
run twice (a reply lost, the call retried; a close cut off half-way and run again) counts once. `refs` also counts
references taken without a holder; the GC script reads `refs` alone.
"""

from __future__ import annotations

from typing import Any

# KEYS: meta, holders, holdings; ARGV: holder, delta (+1 / -1), the holdings' member
HOLD_LUA = """
local add = tonumber(ARGV[2]) > 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  if not add then redis.call('SREM', KEYS[3], ARGV[3]) end
  return false
end
local changed
if add then
  changed = redis.call('SADD', KEYS[2], ARGV[1])
  redis.call('SADD', KEYS[3], ARGV[3])
else
  changed = redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('SREM', KEYS[3], ARGV[3])
end
if changed == 1 then return redis.call('HINCRBY', KEYS[1], 'refs', ARGV[2]) end
return tonumber(redis.call('HGET', KEYS[1], 'refs'))
"""


def holders_key(tenant: str, ref: str) -> str:
    return f"kvf:t:{tenant}:h:{ref}"


def holdings_key(holder: str) -> str:
    return f"kvf:holds:{holder}"


class RedisHolders:
    """The two calls, on a redis-py client (`r`)."""

    def __init__(self, r: Any) -> None:
        self.r, self._s_hold = r, r.register_script(HOLD_LUA)

    def hold(self, meta_key: str, tenant: str, ref: str, holder: str, delta: int) -> int | None:
        out = self._s_hold(keys=[meta_key, holders_key(tenant, ref), holdings_key(holder)],
                           args=[holder, delta, f"{tenant}:{ref}"])
        return None if out is None else int(out)

    def held(self, holder: str) -> list[tuple[str, str]]:
        members: set[bytes] = self.r.smembers(holdings_key(holder))
        return [(ref, tenant) for tenant, ref in (m.decode().split(":", 1) for m in members)]
