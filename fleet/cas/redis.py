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
tenant's byte count (and checks its quota), and the GC script (fleet/cas/redis_gc.py) that deletes a blob lowers it by the
`charge` the put recorded in the blob's metadata (a blob stored before charges were recorded gave
its size alone, and gives back its size alone), so a put then its collection leaves the count exactly
where it was, whatever PER_BLOB_OVERHEAD was or becomes.
Refusals, lost connections and a failover behind the store's address (READONLY: the pool is reset and the
call runs once more): fleet/cas/redis_errors.py.
NOTE: blobs a Redis store held before the byte count existed are not in it (no backfill scan: it
would race live puts); they leave it as they are collected, the count never going below 0.
The put's, counters', verdicts' and compare-and-swap's scripts are in fleet/cas/redis_scripts.py, whole-blob reads
in chunks in fleet/cas/redis_reads.py.
"""

from __future__ import annotations

import json
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fleet.cas import redis_reads
from fleet.cas.base import BlobMeta, BlobStore, StoreConfig, blob_charge
from fleet.cas.redis_errors import store_call
from fleet.cas.redis_fit import eviction_refusal
from fleet.cas.redis_gc import RedisGc
from fleet.cas.redis_holders import RedisHolders
from fleet.cas.redis_pieces import PIECE_BYTES, PiecedPut, in_flight_key, over_quota_out
from fleet.cas.redis_scripts import INCR_LUA, KV_PUT_BOUNDED_LUA, KV_SWAP_LUA, PUT_LUA, TOUCH_LUA, VERDICT_LUA
from fleet.cas.types import at_zero
from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.core.verdict import UNKNOWN

# NOTE: a duplicate of a large blob is detected with one small round trip before the bytes are sent.
_PRECHECK_BYTES = 256 << 10
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
        self._s_put = self.r.register_script(PUT_LUA)
        self._s_touch = self.r.register_script(TOUCH_LUA)
        self._s_incr = self.r.register_script(INCR_LUA)
        self._holders = RedisHolders(self.r)
        self._s_verdict = self.r.register_script(VERDICT_LUA)
        self._gc_scan = RedisGc(self.r)
        self._s_kv_swap = self.r.register_script(KV_SWAP_LUA)
        self._s_kv_put_bounded = self.r.register_script(KV_PUT_BOUNDED_LUA)
        self._pieces = PiecedPut(self.r, f"redis at {self.host}:{self.port}")
        self._evicting: str | None = None  # what the last unfit() found: data writes are refused while it is set
        try:
            self.ping()
            self._refuse_eviction()
        except BaseException:
            self.r.close()
            raise

    @store_call
    def ping(self) -> None:
        self.r.ping()

    def _refuse_eviction(self) -> None:
        why = self.unfit()
        if why is not None:
            raise FailedPrecondition(why)

    @store_call
    def unfit(self) -> str | None:
        """Why this Redis is refused (fleet/cas/redis_fit.py: its maxmemory-policy evicts keys without a TTL), else
        None; what it finds also refuses or lets through the data writes (`_refuse_while_evicting`). One INFO; the
        controller's store probe asks it at each probe too (controller/store_probe.py)."""
        self._evicting = eviction_refusal(self.r, f"{self.host}:{self.port}")
        return self._evicting

    def _refuse_while_evicting(self) -> None:
        """Refuse a write of tenant data (a blob, an op log) while the last unfit() found this Redis evicting
        (fleet/cas/redis_fit.py says why); the controller's own keys (kv_*) are still written."""
        if self._evicting is not None:
            raise FailedPrecondition(f"write refused, the store cannot keep it: {self._evicting}")

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
        self._refuse_while_evicting()
        keys = self._put_keys(tenant, ref)
        lease = repr(self._lease(now))
        self._pieces.drop_undropped()  # NOTE: only a pieced put did: a small one counted a failed put's reservation
        if data.nbytes > PIECE_BYTES:
            return self._pieces.put(tenant, ref, keys, data, now, quota, lease)
        if data.nbytes >= _PRECHECK_BYTES and self._s_touch(keys=[keys[1], keys[0]], args=[lease]):
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
        self._refuse_while_evicting()
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
            self._s_touch(keys=[*reversed(self._keys(tenant, ref))], args=[lease], client=pipe)
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
        return redis_reads.get_many(self.r, [self._keys(tenant, ref)[0] for ref in refs])

    @store_call
    def _get(self, tenant: str, ref: str) -> bytes | None:
        return redis_reads.get(self.r, self._keys(tenant, ref)[0])

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
    def _incr(self, tenant: str, ref: str, counter: str, delta: int) -> BlobMeta | None:
        out = self._s_incr(keys=[self._keys(tenant, ref)[1]], args=[counter, delta])
        if out is None:
            return None
        if not isinstance(out, list):
            raise at_zero(ref, tenant, counter)
        return self._meta(ref, dict(zip(out[::2], out[1::2], strict=True)))

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
        return self._gc_scan.collect(now, self._put_keys)

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
    def _kv_len(self, namespace: str) -> int:
        return int(self.r.hlen(f"kvf:kv:{namespace}"))

    @store_call
    def _kv_put_bounded(self, namespace: str, key: str, value: bytes, max_keys: int) -> bool:
        return bool(self._s_kv_put_bounded(keys=[f"kvf:kv:{namespace}"], args=[key, value, max_keys]))

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
        self._refuse_while_evicting()
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
        self._refuse_while_evicting()
        key, pipe = f"kvf:t:{tenant}:op:{session_id}", self.r.pipeline(transaction=True)  # MULTI/EXEC: all or none
        pipe.delete(key)
        for i in range(0, len(ops_json), 4096):
            pipe.rpush(key, *ops_json[i:i + 4096])
        pipe.execute()

    def close(self) -> None:
        self.r.close()
