"""A large blob reaches Redis in pieces, so that one tenant's put never holds Redis for the whole blob.

Redis runs one command at a time, and with AOF `appendfsync always` it writes and fsyncs a command's effects
before it serves anything else. A put in one command (a 32 MiB blob in one script call) made every other
tenant's call wait for that whole write: another process's stat() of a small blob went from p99 0.5 ms to
333 ms beside one tenant's 32 MiB puts. Now a blob larger than PIECE_BYTES is sent piece by piece to a
staging key of its own, one command per piece (other clients' commands run between them), and one small
script commits it:

    begin   KEYS data, meta, bytes        stored already: extend the lease, done; over quota: refuse, done
    append  KEYS stage (once per piece)   the first piece SETs the stage with a TTL, each next one APPENDs
                                          and renews it; a stage that is gone (expired, evicted) fails the put
    commit  KEYS data, meta, bytes, stage stored meanwhile: drop the stage, extend the lease; else the quota
                                          check, the byte count, RENAME stage -> data (O(1)), PERSIST, metadata
                                          (metadata whose bytes went: the bytes back under it, nothing charged)

So a put is still all or nothing: until the commit nothing is visible or charged, and the commit is one
script (the dedup check, the quota check and the count with the write, as the one-command put did). A put
that fails between pieces deletes its stage (when Redis cannot take the delete, before the store's next put:
PiecedPut._drop); one whose process dies leaves a stage that Redis expires
STAGE_TTL_MS after its last piece (each stage key is its put's own: `kvf:t:{tenant}:p:{ref}:{nonce}`).
The stored blob is the same single STRING key as before, so blobs stored the old way need nothing.

Bytes in flight count against the tenant's quota. The begin reserves the blob's charge in the tenant's
`kvf:t:{tenant}:inflight` sorted set (member `{charge}:{ref}:{nonce}`, scored by when it lapses, on Redis's
clock), each piece renews it with its stage, and the commit or a failed put removes it. A put is admitted
only while the tenant's stored bytes, its reservations (each distinct blob once: concurrent puts of one blob
store it once) and the new blob fit the quota; the one-command put checks the same sum. A dead process's
reservation lapses with its stage (the next check drops it; the set itself expires with its last put's stage). NOTE: without it, a tenant at its quota could
begin any number of large puts at once (each fit beside the stored bytes alone) and stage all of their bytes in
the Redis every tenant shares, each refused only at its commit.
"""

from __future__ import annotations

import dataclasses
import os

import redis

from fleet.cas.redis_undropped import Undropped
from fleet.cas.types import blob_charge
from fleet.core.errors import Unavailable
from fleet.core.verdict import UNKNOWN

# NOTE: chosen by measurement (bench/store_reads.py's Redis setup: 3 writers of 32 MiB blobs, a reader's stat,
# AOF rewrites on, two 4 s runs each, a shared 2-core machine): the reader's p99 was 31-32 ms with 512 KiB
# pieces, 26-33 ms with 1 MiB, 34-145 ms with 2 MiB, 56-78 ms with 4 MiB, 190-349 ms in one command; puts done
# were about the same (each piece is a write and an fsync of its own, but so is the whole blob).
PIECE_BYTES = 512 << 10
# A stage lives this long after its last piece. A live put sends its next piece within the client's socket
# timeout (60 s) or fails, so twice that never expires a live put's stage.
STAGE_TTL_MS = 120_000

# Failed puts whose stage and reservation one store remembers to give back (Redis was down): in all, and per tenant
# (fleet/cas/redis_undropped.py: one tenant's failures push out only its own).
MAX_UNDROPPED, MAX_UNDROPPED_PER_TENANT = 1024, 64

# Prepended to the scripts that admit a put. The charge of the tenant's puts in flight (each distinct ref once,
# lapsed reservations dropped first) and whether `ref` is one of them; and Redis's clock in ms.
# a blob's lease extended to `lease` (never shortened): a put of a blob stored already, a touch
LEASE_LUA = """
local function extend_lease(meta, lease)
  local cur = tonumber(redis.call('HGET', meta, 'lease_expires'))
  if cur == nil or cur < tonumber(lease) then redis.call('HSET', meta, 'lease_expires', lease) end
end
"""

IN_FLIGHT_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function in_flight(key, ref)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms())
  local seen, total = {}, 0
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    local charge, r = string.match(m, '^(%d+):([^:]+):')
    if not seen[r] then
      seen[r] = true
      total = total + tonumber(charge)
    end
  end
  return total, seen[ref] == true
end
"""

# KEYS: data, meta, byte count, in flight; ARGV: lease, quota, charge, reservation, ttl ms, ref.
# 0: stored already (lease extended); {used, in flight}: over quota; 1: go (reserved)
_BEGIN = LEASE_LUA + IN_FLIGHT_LUA + """
if redis.call('EXISTS', KEYS[1], KEYS[2]) == 2 then
  extend_lease(KEYS[2], ARGV[1])
  return 0
end
local used, quota = tonumber(redis.call('GET', KEYS[3]) or '0'), tonumber(ARGV[2])
local flying, mine = in_flight(KEYS[4], ARGV[6])
local charge = tonumber(ARGV[3])
if mine then charge = 0 end
if quota > 0 and used + flying + charge > quota then return {used, flying} end
redis.call('ZADD', KEYS[4], now_ms() + tonumber(ARGV[5]), ARGV[4])
redis.call('PEXPIRE', KEYS[4], ARGV[5])
return 1
"""

# KEYS: stage, in flight; ARGV: piece, ttl ms, '1' for the first piece, reservation. 1: appended; 0: the stage is
# gone. The reservation lapses with the stage.
_APPEND = IN_FLIGHT_LUA + """
if ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
else
  redis.call('APPEND', KEYS[1], ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[2]), ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

# KEYS: data, meta, byte count, stage, in flight; ARGV: size, now, lease, verdict, quota, charge, reservation.
# 1: stored; 0: stored already (lease extended), or its bytes put back under metadata whose bytes went (as PUT_LUA);
# -1: the stage is gone or short; {used, 0}: over quota.
# Every outcome ends the put's reservation (stored, its charge is in the byte count).
_COMMIT = LEASE_LUA + """
redis.call('ZREM', KEYS[5], ARGV[7])
if redis.call('EXISTS', KEYS[1], KEYS[2]) == 2 then
  extend_lease(KEYS[2], ARGV[3])
  redis.call('DEL', KEYS[4])
  return 0
end
if redis.call('STRLEN', KEYS[4]) ~= tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[4])
  return -1
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('RENAME', KEYS[4], KEYS[1])
  redis.call('PERSIST', KEYS[1])
  extend_lease(KEYS[2], ARGV[3])
  return 0
end
local used, quota = tonumber(redis.call('GET', KEYS[3]) or '0'), tonumber(ARGV[5])
if quota > 0 and used + tonumber(ARGV[6]) > quota then
  redis.call('DEL', KEYS[4])
  return {used, 0}
end
redis.call('INCRBY', KEYS[3], ARGV[6])
redis.call('RENAME', KEYS[4], KEYS[1])
redis.call('PERSIST', KEYS[1])
redis.call('HSET', KEYS[2], 'size', ARGV[1], 'charge', ARGV[6], 'created', ARGV[2], 'pins', '0', 'refs', '0',
           'verdict', ARGV[4], 'reasons', '[]', 'lease_expires', ARGV[3])
return 1
"""


def in_flight_key(tenant: str) -> str:
    """The tenant's reservations of puts in flight (module doc)."""
    return f"kvf:t:{tenant}:inflight"


def over_quota_out(out: object) -> tuple[int, int] | None:
    """A put script's answer as (stored bytes, bytes in flight) when it refused over the quota, else None."""
    if not isinstance(out, list):
        return None
    return int(out[0]), int(out[1]) if len(out) > 1 else 0


@dataclasses.dataclass(frozen=True)
class _Put:
    """One pieced put's keys: its staging key (its own nonce), the tenant's in-flight set and its reservation."""
    tenant: str
    stage: str
    flying: str
    member: str


class PiecedPut:
    """Puts of blobs larger than PIECE_BYTES (module doc). `where` names the server in errors."""

    def __init__(self, r: redis.Redis, where: str) -> None:
        self.r, self.where = r, where
        self._s_begin = r.register_script(_BEGIN)
        self._s_append = r.register_script(_APPEND)
        self._s_commit = r.register_script(_COMMIT)
        # failed puts whose stage and reservation Redis did not take back yet
        self._undropped: Undropped[_Put] = Undropped(MAX_UNDROPPED_PER_TENANT, MAX_UNDROPPED)

    def put(self, tenant: str, ref: str, keys: list[str], data: memoryview, now: float, quota: int,
            lease: str) -> tuple[int, int] | None:
        """Store `data` under `keys` (data, metadata, byte count), as `_PUT` does in one command.

        Returns:
            None: stored, or stored already (its lease extended); (stored bytes, bytes in flight): refused over
            `quota` (nothing written).

        Raises:
            Unavailable: the staging key vanished mid-put (nothing stored); redis errors as they come.
        """
        charge, nonce = blob_charge(data.nbytes), os.urandom(8).hex()
        put = _Put(tenant, f"kvf:t:{tenant}:p:{ref}:{nonce}", in_flight_key(tenant), f"{charge}:{ref}:{nonce}")
        self.drop_undropped()
        try:  # NOTE: the begin too: a reply lost after Redis applied it leaves a reservation
            out = self._s_begin(keys=[*keys, put.flying], args=[lease, quota, charge, put.member, STAGE_TTL_MS, ref])
            if out != 1:
                return over_quota_out(out)
            self._send(put, ref, data)
            out = self._s_commit(keys=[*keys, put.stage, put.flying],
                                 args=[data.nbytes, repr(now), lease, UNKNOWN, quota, charge, put.member])
        except BaseException:
            self._drop(put)
            raise
        if out == -1:
            raise self._lost(ref)
        return over_quota_out(out)

    def _send(self, put: _Put, ref: str, data: memoryview) -> None:
        for start in range(0, data.nbytes, PIECE_BYTES):
            self.append_piece(put, ref, data[start:start + PIECE_BYTES], first=start == 0)

    def append_piece(self, put: _Put, ref: str, piece: memoryview, *, first: bool) -> None:
        """One piece, one command (tests wrap this to stop a put between two pieces)."""
        if not self._s_append(keys=[put.stage, put.flying], args=[piece, STAGE_TTL_MS, "1" if first else "0",
                                                                   put.member]):
            raise self._lost(ref)

    def _drop(self, *puts: _Put) -> None:
        """Give back failed puts' stages and reservations. Those Redis did not take (it was down, or restarted
        mid-put) are kept and given back before this store's next put, of any size (or lapse by their TTL if this
        process ends first). NOTE: before, one failed put while Redis restarted held its reservation for
        STAGE_TTL_MS: the tenant's other puts were refused over a quota that only the failed put filled; then a small put
        (one command, never in pieces) did not give them back and was refused so for those 120 s."""
        try:
            pipe = self.r.pipeline(transaction=False)
            for put in puts:
                pipe.delete(put.stage)
                pipe.zrem(put.flying, put.member)
            pipe.execute()
        except redis.exceptions.RedisError:
            for put in puts:  # each tenant's within its own bound (fleet/cas/redis_undropped.py)
                self._undropped.add(put.tenant, put)

    def drop_undropped(self) -> None:
        """Give back what `_drop` could not (before any put of the store: a put of any size counts reservations)."""
        puts = [put for _, put in self._undropped.take_all()]
        if puts:
            self._drop(*puts)

    def _lost(self, ref: str) -> Unavailable:
        return Unavailable(f"{self.where} dropped the pieces of blob {ref} while it was being put (its staging key "
                           "expired or was evicted); nothing was stored: put it again")
