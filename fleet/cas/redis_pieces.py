"""A large blob reaches Redis in pieces, so that one tenant's put never holds Redis for the whole blob.

Redis runs one command at a time, and with AOF `appendfsync always` it writes and fsyncs a command's effects
before it serves anything else. A put in one command (a 32 MiB blob in one script call) made every other
tenant's call wait for that whole write: another process's stat() of a small blob went from p99 0.5 ms to
333 ms beside one tenant's 32 MiB puts. Now a blob larger than PIECE_BYTES is sent piece by piece to a
staging key of its own, one command per piece (other clients' commands run between them), and one small
script commits it:

    begin   KEYS meta, bytes              stored already: extend the lease, done; over quota: refuse, done
    append  KEYS stage (once per piece)   the first piece SETs the stage with a TTL, each next one APPENDs
                                          and renews it; a stage that is gone (expired, evicted) fails the put
    commit  KEYS data, meta, bytes, stage stored meanwhile: drop the stage, extend the lease; else the quota
                                          check, the byte count, RENAME stage -> data (O(1)), PERSIST, metadata

So a put is still all or nothing: until the commit nothing is visible or charged, and the commit is one
script (the dedup check, the quota check and the count with the write, as the one-command put did). A put
that fails between pieces deletes its stage; one whose process dies leaves a stage that Redis expires
STAGE_TTL_MS after its last piece (each stage key is its put's own: `kvf:t:{tenant}:p:{ref}:{nonce}`).
The stored blob is the same single STRING key as before, so blobs stored the old way need nothing.
"""

from __future__ import annotations

import os

import redis

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

# KEYS: meta, byte count; ARGV: lease, quota, charge. 0: stored already (lease extended); {used}: over quota; 1: go
_BEGIN = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local cur = tonumber(redis.call('HGET', KEYS[1], 'lease_expires'))
  if cur == nil or cur < tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'lease_expires', ARGV[1]) end
  return 0
end
local used, quota = tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(ARGV[2])
if quota > 0 and used + tonumber(ARGV[3]) > quota then return {used} end
return 1
"""

# KEYS: stage; ARGV: piece, ttl ms, '1' for the first piece. 1: appended; 0: the stage is gone.
_APPEND = """
if ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('APPEND', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: data, meta, byte count, stage; ARGV: size, now, lease, verdict, quota, charge.
# 1: stored; 0: stored already (lease extended); -1: the stage is gone or short; {used}: over quota.
_COMMIT = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  local cur = tonumber(redis.call('HGET', KEYS[2], 'lease_expires'))
  if cur == nil or cur < tonumber(ARGV[3]) then redis.call('HSET', KEYS[2], 'lease_expires', ARGV[3]) end
  redis.call('DEL', KEYS[4])
  return 0
end
if redis.call('STRLEN', KEYS[4]) ~= tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[4])
  return -1
end
local used, quota = tonumber(redis.call('GET', KEYS[3]) or '0'), tonumber(ARGV[5])
if quota > 0 and used + tonumber(ARGV[6]) > quota then
  redis.call('DEL', KEYS[4])
  return {used}
end
redis.call('INCRBY', KEYS[3], ARGV[6])
redis.call('RENAME', KEYS[4], KEYS[1])
redis.call('PERSIST', KEYS[1])
redis.call('HSET', KEYS[2], 'size', ARGV[1], 'charge', ARGV[6], 'created', ARGV[2], 'pins', '0', 'refs', '0',
           'verdict', ARGV[4], 'reasons', '[]', 'lease_expires', ARGV[3])
return 1
"""


def stage_key(tenant: str, ref: str) -> str:
    """A fresh staging key for one put of `ref` (tenant names exclude ':'; its own nonce per put)."""
    return f"kvf:t:{tenant}:p:{ref}:{os.urandom(8).hex()}"


class PiecedPut:
    """Puts of blobs larger than PIECE_BYTES (module doc). `where` names the server in errors."""

    def __init__(self, r: redis.Redis, where: str) -> None:
        self.r, self.where = r, where
        self._s_begin = r.register_script(_BEGIN)
        self._s_append = r.register_script(_APPEND)
        self._s_commit = r.register_script(_COMMIT)

    def put(self, tenant: str, ref: str, keys: list[str], data: memoryview, now: float, quota: int,
            lease: str) -> int | None:
        """Store `data` under `keys` (data, metadata, byte count), as `_PUT` does in one command.

        Returns:
            None: stored, or stored already (its lease extended); an int: refused over `quota`, the tenant's
            stored bytes then (nothing written).

        Raises:
            Unavailable: the staging key vanished mid-put (nothing stored); redis errors as they come.
        """
        charge = blob_charge(data.nbytes)
        out = self._s_begin(keys=keys[1:], args=[lease, quota, charge])
        if out != 1:
            return int(out[0]) if isinstance(out, list) else None
        stage = stage_key(tenant, ref)
        try:
            self._send(stage, ref, data)
            out = self._s_commit(keys=[*keys, stage], args=[data.nbytes, repr(now), lease, UNKNOWN, quota, charge])
        except BaseException:
            self._drop(stage)
            raise
        if out == -1:
            raise self._lost(ref)
        return int(out[0]) if isinstance(out, list) else None

    def _send(self, stage: str, ref: str, data: memoryview) -> None:
        for start in range(0, data.nbytes, PIECE_BYTES):
            self.append_piece(stage, ref, data[start:start + PIECE_BYTES], first=start == 0)

    def append_piece(self, stage: str, ref: str, piece: memoryview, *, first: bool) -> None:
        """One piece, one command (tests wrap this to stop a put between two pieces)."""
        if not self._s_append(keys=[stage], args=[piece, STAGE_TTL_MS, "1" if first else "0"]):
            raise self._lost(ref)

    def _drop(self, stage: str) -> None:
        """Best effort: a stage not deleted here expires by its TTL."""
        try:
            self.r.delete(stage)
        except redis.exceptions.RedisError:
            pass

    def _lost(self, ref: str) -> Unavailable:
        return Unavailable(f"{self.where} dropped the pieces of blob {ref} while it was being put (its staging key "
                           "expired or was evicted); nothing was stored: put it again")

