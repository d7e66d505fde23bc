"""Redis backend. redis-py is imported only here, i.e. only when a redis:// URL is opened.

Key layout (tenant names exclude ':', so a tenant can never reach another tenant's keys):

    kvf:t:{tenant}:b:{ref}          STRING  the blob bytes
    kvf:t:{tenant}:m:{ref}          HASH    size, charge, created, pins, refs, verdict, reasons, lease_expires
    kvf:t:{tenant}:op:{session_id}  LIST    the session's op log, one JSON op per element
    kvf:t:{tenant}:bytes            STRING  the tenant's stored blob bytes (sum of its blobs' charges:
                                            size + PER_BLOB_OVERHEAD), changed by the same script
                                            that writes or deletes a blob
    kvf:t:{tenant}:p:{ref}:{nonce}  STRING  one put's pieces so far, with a TTL (fleet/cas/redis_pieces.py)
    kvf:t:{tenant}:inflight         ZSET    the charges of the tenant's pieced puts in flight, which its quota
                                            counts (fleet/cas/redis_pieces.py)
    kvf:t:{tenant}:h:{ref}          SET     the blob's named holders; kvf:holds:{holder}: what a holder holds
                                            (fleet/cas/redis_holders.py)
    kvf:kv:{namespace}              HASH    controller state, key -> value

Atomicity: a put of up to PIECE_BYTES is ONE EVALSHA whose arguments carry the bytes; Redis runs a script
only after its whole command has arrived, and runs it without interleaving, so the data key and the metadata
hash appear together or not at all. A client killed mid-transfer leaves nothing. A larger blob is sent in
pieces to a staging key and made visible by one commit script (fleet/cas/redis_pieces.py: no command carries
more than a piece, so other tenants' calls run between them). The put (or commit) script keeps the
tenant's byte count (and checks its quota), and the GC script that deletes a blob lowers it by the
`charge` the put recorded in the blob's metadata (a blob stored before charges were recorded gave
its size alone, and gives back its size alone), so a put then its collection leaves the count exactly
where it was, whatever PER_BLOB_OVERHEAD was or becomes.
Refusals, lost connections and a failover behind the store's address (READONLY: the pool is reset and the
call runs once more): fleet/cas/redis_errors.py.
NOTE: blobs a Redis store held before the byte count existed are not in it (no backfill scan: it
would race live puts); they leave it as they are collected, the count never going below 0.
"""

from __future__ import annotations

import json
import re
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fleet.cas.base import BlobMeta, BlobStore, StoreConfig, blob_charge
from fleet.cas.redis_errors import store_call
from fleet.cas.redis_holders import RedisHolders
from fleet.cas.redis_pieces import IN_FLIGHT_LUA, PIECE_BYTES, PiecedPut, in_flight_key, over_quota_out
from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.core.verdict import UNKNOWN

# KEYS: data, meta, byte count, in flight; ARGV: data, size, now, lease, verdict, quota, charge, ref.
# 1: stored; 0: stored already (lease extended); {used, in flight}: over quota (pieced puts in flight count)
_PUT = IN_FLIGHT_LUA + """
if redis.call('EXISTS', KEYS[2]) == 1 then
  local cur = tonumber(redis.call('HGET', KEYS[2], 'lease_expires'))
  if cur == nil or cur < tonumber(ARGV[4]) then redis.call('HSET', KEYS[2], 'lease_expires', ARGV[4]) end
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

_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local cur = tonumber(redis.call('HGET', KEYS[1], 'lease_expires'))
if cur == nil or cur < tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'lease_expires', ARGV[1]) end
return 1
"""

_INCR = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local v = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) + tonumber(ARGV[2])
if v < 0 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], v)
return v
"""

_VERDICT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'verdict', ARGV[1], 'reasons', ARGV[2])
return 1
"""

# KEYS[1]: a kv namespace's hash; ARGV: key, '1' + old value or '0' (absent), '1' + new value or '0' (delete).
_KV_SWAP = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '0' then
  if cur then return 0 end
elseif cur ~= string.sub(ARGV[2], 2) then
  return 0
end
if ARGV[3] == '0' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], string.sub(ARGV[3], 2)) end
return 1
"""

# KEYS: (data, metadata, byte count) of each blob in turn; ARGV[1]: now. Returns how many it deleted.
# Each blob is judged on its own as before (a damaged one is skipped, never deleted blind); one call
# takes a batch of blobs (_GC_BATCH) instead of one round trip each.
_GC_MANY = """
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

# NOTE: a duplicate of a large blob is detected with one small round trip before the bytes are sent.
_PRECHECK_BYTES = 256 << 10
_GET_CHUNK = 512 << 10
# NOTE: chunks a whole-blob read asks for in one round trip. Redis runs every command of a pipeline that has
# arrived before it serves another client, so one pipeline of all of a 64 MiB blob's chunks copied 64 MiB into
# its reply before anyone else was served.
_GET_WINDOW = 4
_PIPE_BYTES = 16 << 20

class RedisBlobStore(BlobStore):
    """BlobStore on a Redis server (production; AOF on for durability)."""

    def __init__(self, cfg: StoreConfig) -> None:
        super().__init__(cfg)
        u = urlparse(cfg.url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        # NOTE: no automatic retries: a retried RPUSH/HINCR after a lost reply would apply twice.
        self.r = redis.Redis.from_url(cfg.url, socket_connect_timeout=3.0, socket_timeout=60.0,
                                      retry=Retry(NoBackoff(), 0))
        self._s_put = self.r.register_script(_PUT)
        self._s_touch = self.r.register_script(_TOUCH)
        self._s_incr = self.r.register_script(_INCR)
        self._holders = RedisHolders(self.r)
        self._s_verdict = self.r.register_script(_VERDICT)
        self._s_gc = self.r.register_script(_GC_MANY)
        self._s_kv_swap = self.r.register_script(_KV_SWAP)
        self._pieces = PiecedPut(self.r, f"redis at {self.host}:{self.port}")
        try:
            self.ping()
            self._refuse_eviction()
        except BaseException:
            self.r.close()
            raise

    @store_call
    def ping(self) -> None:
        self.r.ping()

    @store_call
    def _refuse_eviction(self) -> None:
        """Refuse a Redis whose maxmemory-policy evicts keys that have no TTL (allkeys-*): every key here is data.

        NOTE: such a Redis was opened without a word, and at its maxmemory one tenant's puts evicted other tenants'
        pinned blobs (a later get: NOT_FOUND) and their own byte count (so their quota counted from 0 again). The
        volatile-* policies evict only keys with a TTL, and the store sets one only on a large put's pieces in
        flight and on the tenant's set of their reservations: evicting pieces fails that put (Unavailable, nothing
        stored), evicting reservations leaves those puts to the commit's quota check, and stored data is refused writes as
        under noeviction. INFO, not CONFIG GET, which managed Redis services often forbid; one that forbids INFO too is opened.
        """
        try:
            policy = str(self.r.info("memory").get("maxmemory_policy", ""))
        except redis.exceptions.ResponseError:  # INFO refused (an ACL, a renamed command): nothing to check
            return
        if policy.startswith("allkeys-"):
            raise FailedPrecondition(
                f"redis at {self.host}:{self.port} evicts keys when it is full (maxmemory-policy {policy}): it "
                "would drop blobs, op logs and byte counts, any tenant's to make room for another's, without an "
                "error. Set maxmemory-policy noeviction on it (a full store then refuses writes with "
                "RESOURCE_EXHAUSTED and keeps what it holds), or give kvfleet a Redis of its own")

    @staticmethod
    def _keys(tenant: str, ref: str) -> tuple[str, str]:
        return f"kvf:t:{tenant}:b:{ref}", f"kvf:t:{tenant}:m:{ref}"

    @staticmethod
    def _usage_key(tenant: str) -> str:
        return f"kvf:t:{tenant}:bytes"

    def _put_keys(self, tenant: str, ref: str) -> list[str]:
        return [*self._keys(tenant, ref), self._usage_key(tenant)]

    # ---- blobs ----------------------------------------------------------------------------------
    @store_call
    def _put(self, tenant: str, ref: str, data: memoryview, now: float, quota: int) -> tuple[int, int] | None:
        keys = self._put_keys(tenant, ref)
        lease = repr(self._lease(now))
        self._pieces.drop_undropped()  # NOTE: only a pieced put did: a small one counted a failed put's reservation
        if data.nbytes > PIECE_BYTES:
            return self._pieces.put(tenant, ref, keys, data, now, quota, lease)
        if data.nbytes >= _PRECHECK_BYTES and self._s_touch(keys=[keys[1]], args=[lease]):
            return None
        out = self._s_put(keys=[*keys, in_flight_key(tenant)], args=[data, data.nbytes, repr(now), lease, UNKNOWN, quota,
                                           blob_charge(data.nbytes), ref])
        return over_quota_out(out)

    @store_call
    def _stored_bytes(self, tenant: str) -> int:
        return int(self.r.get(self._usage_key(tenant)) or 0)

    @store_call
    def _put_many(self, tenant: str, items: list[tuple[str, memoryview]], now: float) -> list[str]:
        # pipelined groups of <= _PIPE_BYTES: one round trip each, bounded server-side buffering; a blob
        # larger than a piece goes in pieces on its own (no command carries more than a piece)
        refs: list[str] = []
        group: list[tuple[str, memoryview]] = []
        for ref, data in items:
            refs.append(ref)
            if data.nbytes > PIECE_BYTES:
                self._pieces.put(tenant, ref, self._put_keys(tenant, ref), data, now, 0, repr(self._lease(now)))
                continue
            group.append((ref, data))
            if sum(d.nbytes for _, d in group) >= _PIPE_BYTES:
                self._put_group(tenant, group, now)
                group = []
        if group:
            self._put_group(tenant, group, now)
        return refs

    def _put_group(self, tenant: str, group: list[tuple[str, memoryview]], now: float) -> None:
        lease, pipe = repr(self._lease(now)), self.r.pipeline(transaction=False)
        large = [ref for ref, data in group if data.nbytes >= _PRECHECK_BYTES]
        for ref in large:  # dedup pre-check of the large ones: one small round trip for the group
            self._s_touch(keys=[self._keys(tenant, ref)[1]], args=[lease], client=pipe)
        present = {ref for ref, hit in zip(large, pipe.execute() if large else [], strict=True) if hit}
        for ref, data in group:
            if ref not in present:  # one atomic script per blob
                self._s_put(keys=[*self._put_keys(tenant, ref), in_flight_key(tenant)],
                            args=[data, data.nbytes, repr(now), lease, UNKNOWN, 0, blob_charge(data.nbytes), ref],
                            client=pipe)
        if len(pipe):
            pipe.execute()

    @store_call
    def _get_many(self, tenant: str, refs: list[str]) -> list[bytes | None]:
        # one round trip of GETRANGE 0..CHUNK-1 each; only blobs that fill the chunk need more
        pipe = self.r.pipeline(transaction=False)
        for ref in refs:
            pipe.getrange(self._keys(tenant, ref)[0], 0, _GET_CHUNK - 1)
        firsts = pipe.execute()
        return [self._rest(self._keys(tenant, ref)[0], first) for ref, first in zip(refs, firsts, strict=True)]

    @store_call
    def _get(self, tenant: str, ref: str) -> bytes | None:
        key = self._keys(tenant, ref)[0]
        return self._rest(key, self.r.getrange(key, 0, _GET_CHUNK - 1))  # type: ignore[arg-type]

    def _rest(self, key: str, first: bytes) -> bytes | None:
        """Complete a read that fetched the first chunk (an empty one means empty or missing).

        NOTE: a plain GET of a large value peaks at ~3 copies inside redis-py's reader; reading it
        in pipelined GETRANGE chunks and joining them peaks at ~2 (the chunks + the result).
        """
        if not first:
            return b"" if self.r.exists(key) else None
        if len(first) < _GET_CHUNK:
            return first
        size, chunks = int(self.r.strlen(key)), [first]
        starts = list(range(_GET_CHUNK, size, _GET_CHUNK))
        for i in range(0, len(starts), _GET_WINDOW):  # NOTE: a window a round trip (module NOTE at _GET_WINDOW)
            pipe = self.r.pipeline(transaction=False)
            for start in starts[i:i + _GET_WINDOW]:
                pipe.getrange(key, start, min(start + _GET_CHUNK, size) - 1)
            chunks += pipe.execute()
        if sum(map(len, chunks)) != size:  # collected by gc while we read: as if missing
            return None
        return b"".join(chunks) if len(chunks) > 1 else first

    @store_call
    def _get_range(self, tenant: str, ref: str, start: int, length: int) -> bytes | None:
        chunk: bytes = self.r.getrange(self._keys(tenant, ref)[0], start, start + length - 1)  # type: ignore[assignment]
        return chunk if chunk else None

    @store_call
    def _stat(self, tenant: str, ref: str) -> BlobMeta | None:
        h: dict[bytes, bytes] = self.r.hgetall(self._keys(tenant, ref)[1])  # type: ignore[assignment]
        return self._meta(ref, h) if h else None

    @staticmethod
    def _meta(ref: str, h: dict[bytes, bytes]) -> BlobMeta:
        return BlobMeta(ref=ref, size=int(h[b"size"]), created=float(h[b"created"]), pins=int(h[b"pins"]),
                        refs=int(h[b"refs"]), verdict=h[b"verdict"].decode(),
                        reasons=tuple(json.loads(h[b"reasons"])), lease_expires=float(h[b"lease_expires"]))

    @store_call
    def _stat_many(self, tenant: str, refs: list[str]) -> list[BlobMeta | None]:
        pipe = self.r.pipeline(transaction=False)  # one round trip (NOTE: one HGETALL each was ~0.1 ms apiece)
        for ref in refs:
            pipe.hgetall(self._keys(tenant, ref)[1])
        return [None if not h else self._meta(ref, h) for ref, h in zip(refs, pipe.execute(), strict=True)]

    @store_call
    def _incr(self, tenant: str, ref: str, counter: str, delta: int) -> int | None:
        out = self._s_incr(keys=[self._keys(tenant, ref)[1]], args=[counter, delta])
        return None if out is None else int(out)

    @store_call
    def _hold_one(self, tenant: str, ref: str, holder: str, delta: int) -> int | None:
        return self._holders.hold(self._keys(tenant, ref)[1], tenant, ref, holder, delta)

    @store_call
    def _held(self, holder: str) -> list[tuple[str, str]]:
        return self._holders.held(holder)

    @store_call
    def _set_verdict(self, tenant: str, ref: str, verdict: str, reasons_json: str) -> bool:
        return bool(self._s_verdict(keys=[self._keys(tenant, ref)[1]], args=[verdict, reasons_json]))

    @store_call
    def _gc(self, now: float) -> int:
        """Collect blob by blob, _GC_BATCH blobs a script call; a key that only looks like metadata (the
        op log of a session named `x:m:y` matches the scan pattern too), or metadata that is not a hash
        of numbers, is skipped and kept, so no key can abort GC for every tenant."""
        deleted, batch = 0, []
        for key in self.r.scan_iter(match="kvf:t:*:m:*", count=1000):
            m = _META_KEY.fullmatch(key.decode("utf-8", "replace"))
            if m is not None:
                batch += self._put_keys(*m.groups())
            if len(batch) >= 3 * _GC_BATCH:
                deleted += int(self._s_gc(keys=batch, args=[repr(now)]))
                batch = []
        if batch:
            deleted += int(self._s_gc(keys=batch, args=[repr(now)]))
        return deleted

    # ---- controller state -------------------------------------------------------------------------
    @store_call
    def _kv_put(self, namespace: str, key: str, value: bytes) -> None:
        self.r.hset(f"kvf:kv:{namespace}", key, value)

    @store_call
    def _kv_get(self, namespace: str, key: str) -> bytes | None:
        return self.r.hget(f"kvf:kv:{namespace}", key)  # type: ignore[return-value]

    @store_call
    def _kv_get_many(self, namespace: str, keys: list[str]) -> list[bytes | None]:
        return self.r.hmget(f"kvf:kv:{namespace}", keys) if keys else []  # type: ignore[return-value]

    @store_call
    def _kv_scan(self, namespace: str) -> dict[str, bytes]:
        h: dict[bytes, bytes] = self.r.hgetall(f"kvf:kv:{namespace}")  # type: ignore[assignment]
        return {k.decode(): v for k, v in h.items()}

    @store_call
    def _kv_delete(self, namespace: str, key: str) -> None:
        self.r.hdel(f"kvf:kv:{namespace}", key)

    @store_call
    def _kv_scan_page(self, namespace: str, cursor: str, count: int) -> tuple[str, dict[str, bytes]]:
        if cursor and not cursor.isdigit():
            raise InvalidArgument(f"invalid cursor {cursor!r}: pass back what kv_scan_page returned")
        nxt, h = self.r.hscan(f"kvf:kv:{namespace}", int(cursor or 0), count=count)
        page: dict[bytes, bytes] = h  # type: ignore[assignment]  # COUNT: a hint (a small hash answers whole)
        return ("" if int(nxt) == 0 else str(nxt)), {k.decode(): v for k, v in page.items()}

    @store_call
    def _kv_delete_many(self, namespace: str, keys: list[str]) -> None:
        self.r.hdel(f"kvf:kv:{namespace}", *keys)

    @store_call
    def _kv_swap(self, namespace: str, key: str, old: bytes | None, new: bytes | None) -> bool:
        def arg(v: bytes | None) -> bytes:
            return b"0" if v is None else b"1" + v

        return bool(self._s_kv_swap(keys=[f"kvf:kv:{namespace}"], args=[key, arg(old), arg(new)]))

    # ---- op log -------------------------------------------------------------------------------------
    @store_call
    def _oplog_append(self, tenant: str, session_id: str, op_json: str) -> int:
        return int(self.r.rpush(f"kvf:t:{tenant}:op:{session_id}", op_json)) - 1

    @store_call
    def _oplog_read(self, tenant: str, session_id: str) -> list[str]:
        items: list[bytes] = self.r.lrange(f"kvf:t:{tenant}:op:{session_id}", 0, -1)  # type: ignore[assignment]
        return [i.decode() for i in items]

    @store_call
    def _oplog_delete(self, tenant: str, session_id: str) -> bool:
        return int(self.r.delete(f"kvf:t:{tenant}:op:{session_id}")) > 0

    @store_call
    def _oplog_replace(self, tenant: str, session_id: str, ops_json: list[str]) -> None:
        key, pipe = f"kvf:t:{tenant}:op:{session_id}", self.r.pipeline(transaction=True)  # MULTI/EXEC: all or none
        pipe.delete(key)
        for i in range(0, len(ops_json), 4096):
            pipe.rpush(key, *ops_json[i:i + 4096])
        pipe.execute()

    def close(self) -> None:
        self.r.close()
