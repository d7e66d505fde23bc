"""The blob-store interface: validation, hashing and size limits shared by every backend.

A blob's ref is the lowercase SHA-256 hex of its bytes. Every public method validates its input
*before* touching the backend, so bad input raises a clear `fleet.core.errors` error and writes nothing.
Backends implement the `_`-prefixed primitives; each primitive is one transaction (SQLite) or one
script/command (Redis), which is where atomicity comes from (a Redis put of a large blob sends its pieces
first, invisible, and then commits them with one script: fleet/cas/redis_pieces.py).
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any

from fleet.cas.types import (
    DEFAULT_LEASE_S,
    DEFAULT_MAX_BLOB_BYTES,
    PER_BLOB_OVERHEAD,
    BlobMeta,
    StoreConfig,
    _sha_hex,
    blob_charge,
    check_bytes,
    check_key,
    check_name,
    check_ref,
    check_tenant,
    encode_op,
    not_found,
)
from fleet.core.errors import InvalidArgument, ResourceExhausted
from fleet.core.verdict import VERDICTS

MAX_KV_PAGE = 10_000  # entries one kv_scan_page asks for, keys one kv_delete_many takes

__all__ = [
    "DEFAULT_LEASE_S", "DEFAULT_MAX_BLOB_BYTES", "PER_BLOB_OVERHEAD", "blob_charge",
    "BlobMeta", "BlobStore", "StoreConfig", "check_bytes", "check_key", "check_name", "check_ref", "check_tenant",
    "OverQuota", "over_quota",
]


class OverQuota(ResourceExhausted):
    """A put refused because it would take its tenant's stored blob bytes past the quota."""


def over_quota(tenant: str, used: int, size: int, quota: int, in_flight: int = 0) -> OverQuota:
    """The refusal of a put of a `size`-byte blob that would take `tenant`'s stored blob bytes (`used`,
    each blob counted as `blob_charge` of its size) and the bytes of its puts in progress (`in_flight`, where the
    backend counts them) past `quota`."""
    flying = f" and {in_flight} more in puts in progress" if in_flight else ""
    return OverQuota(
        f"tenant {tenant!r} has {used} blob bytes stored{flying} (each blob counts its size plus {PER_BLOB_OVERHEAD}); "
        f"this blob of {size} bytes (counting {blob_charge(size)}) would take it past "
        f"its quota of {quota} bytes (--max-blob-bytes-per-tenant); nothing was stored. Unpin blobs you no "
        "longer need (stored blobs count until the store GC collects them: unpinned, unreferenced, lease "
        "expired) or ask the operator to raise the quota"
    )


class BlobStore(ABC):
    """Content-addressed, tenant-namespaced blob store plus small controller state and op logs."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg

    # ---- blobs -------------------------------------------------------------------------------
    def put(self, data: bytes | bytearray | memoryview, tenant: str, expected_ref: str | None = None, *,
            quota: int = 0) -> str:
        """Store `data` once for `tenant` and return its ref.

        Args:
            data: the blob bytes (not copied before the backend write).
            tenant: owning tenant.
            expected_ref: if given, the sha256 the caller claims; checked before anything is written.
            quota: if > 0, the most blob bytes `tenant` may have stored (see `stored_bytes`: each blob
                counts its size plus PER_BLOB_OVERHEAD); checked in the same transaction/script as the
                write, so concurrent puts cannot overshoot it.

        Returns:
            The lowercase sha256 hex of `data`. A second put of the same bytes stores nothing new
            (it only extends the lease) and so costs nothing against `quota`.

        Raises:
            InvalidArgument: bad tenant, malformed expected_ref or hash mismatch.
            ResourceExhausted: `data` exceeds `max_blob_bytes`, or storing it would take the
                tenant's stored bytes past `quota` (nothing is written).
        """
        check_tenant(tenant)
        view = check_bytes("data", data)
        if expected_ref is not None:
            check_ref(expected_ref)
        self._check_quota(quota)
        self._check_size(view.nbytes)
        ref = hashlib.sha256(view).hexdigest()
        self._check_expected(ref, expected_ref)
        self._put_checked(tenant, ref, view, self.cfg.clock(), quota)
        return ref

    def put_stream(self, chunks: Iterable[bytes], tenant: str, expected_ref: str | None = None, *,
                   quota: int = 0) -> str:
        """Like `put`, for data arriving in chunks; hashes incrementally, refuses oversize early.

        NOTE: the chunks are gathered into one buffer (the only full copy held here) because the
        write must be a single transaction; the size limit is enforced as chunks arrive.
        """
        check_tenant(tenant)
        if expected_ref is not None:
            check_ref(expected_ref)
        self._check_quota(quota)
        h, buf = hashlib.sha256(), bytearray()
        for chunk in chunks:
            view = check_bytes("chunk", chunk)
            self._check_size(len(buf) + view.nbytes)
            h.update(view)
            buf += view
        ref = h.hexdigest()
        self._check_expected(ref, expected_ref)
        self._put_checked(tenant, ref, memoryview(buf), self.cfg.clock(), quota)
        return ref

    def put_many(self, blobs: list[bytes], tenant: str) -> list[str]:
        """Put several blobs in one batch; every blob is validated before any is written.

        Each blob is still its own atomic put (a failure mid-batch leaves whole blobs, never parts).
        No per-tenant quota here: it is the store's internal batch path, not a tenant-facing one.
        """
        check_tenant(tenant)
        views = [check_bytes("data", b) for b in blobs]
        for v in views:
            self._check_size(v.nbytes)
        # NOTE: hashing on a thread pool was tried: on a 2-CPU host it steals the CPU redis-server
        # needs and was slower than hashing inline (bench/cas_throughput.py).
        return self._put_many(tenant, [(_sha_hex(v), v) for v in views], self.cfg.clock())

    def get_many(self, refs: list[str], tenant: str) -> list[bytes]:
        """Get several blobs in one batch; NotFound (as `get`) if any is missing."""
        check_tenant(tenant)
        for ref in refs:
            check_ref(ref)
        out = self._get_many(tenant, list(refs))
        for ref, data in zip(refs, out, strict=True):
            if data is None:
                raise not_found(ref, tenant)
        return out  # type: ignore[return-value]

    def _put_many(self, tenant: str, items: list[tuple[str, memoryview]], now: float) -> list[str]:
        refs = []
        for ref, view in items:
            self._put(tenant, ref, view, now, 0)
            refs.append(ref)
        return refs

    @staticmethod
    def _check_quota(quota: object) -> None:
        if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
            raise InvalidArgument(f"quota must be an int >= 0 (0: none), got {quota!r}")

    def _put_checked(self, tenant: str, ref: str, view: memoryview, now: float, quota: int) -> None:
        out = self._put(tenant, ref, view, now, quota)
        if out is not None:
            used, in_flight = out if isinstance(out, tuple) else (out, 0)
            raise over_quota(tenant, used, view.nbytes, quota, in_flight)

    def stored_bytes(self, tenant: str) -> int:
        """The bytes `tenant` has stored now, as its quota counts them: each distinct blob once, its size
        plus PER_BLOB_OVERHEAD (`blob_charge`), from its put until GC deletes it (which gives back exactly
        what the put counted); maintained by the backend atomically with each put and each GC delete."""
        check_tenant(tenant)
        return self._stored_bytes(tenant)

    def _get_many(self, tenant: str, refs: list[str]) -> list[bytes | None]:
        return [self._get(tenant, ref) for ref in refs]

    def get(self, ref: str, tenant: str) -> bytes:
        """Return the blob's bytes. Unknown or another tenant's ref -> NotFound (same message)."""
        check_tenant(tenant)
        check_ref(ref)
        data = self._get(tenant, ref)
        if data is None:
            raise not_found(ref, tenant)
        return data

    def get_stream(self, ref: str, tenant: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """Yield the blob in chunks of at most `chunk_size` bytes (validated eagerly)."""
        return self.sized_stream(ref, tenant, chunk_size)[1]

    def sized_stream(
        self, ref: str, tenant: str, chunk_size: int = 1 << 20
    ) -> tuple[int, Generator[bytes, None, None]]:
        """(the blob's size, `get_stream`'s chunks): one metadata read for both (validated eagerly)."""
        check_tenant(tenant)
        check_ref(ref)
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise InvalidArgument(f"chunk_size must be a positive int, got {chunk_size!r}")
        size = self.stat(ref, tenant).size
        return size, self._iter_chunks(tenant, ref, size, chunk_size)

    def _iter_chunks(self, tenant: str, ref: str, size: int, chunk_size: int) -> Generator[bytes, None, None]:
        for start in range(0, size, chunk_size):
            chunk = self._get_range(tenant, ref, start, min(chunk_size, size - start))
            if chunk is None:
                raise not_found(ref, tenant)
            yield chunk

    def stat(self, ref: str, tenant: str) -> BlobMeta:
        """Return the blob's metadata; NotFound like `get`."""
        check_tenant(tenant)
        check_ref(ref)
        meta = self._stat(tenant, ref)
        if meta is None:
            raise not_found(ref, tenant)
        return meta

    def stat_many(self, refs: Sequence[str], tenant: str) -> list[BlobMeta | None]:
        """Each blob's metadata, in order, None where the tenant has none: one round trip where the backend can (a
        Responses follow-up's check reads a chain of hundreds, controller/verdicts.py `Judge.known`)."""
        check_tenant(tenant)
        for ref in refs:
            check_ref(ref)
        return self._stat_many(tenant, list(refs))

    def exists(self, ref: str, tenant: str) -> bool:
        check_tenant(tenant)
        check_ref(ref)
        return self._stat(tenant, ref) is not None

    def pin(self, ref: str, tenant: str) -> None:
        self._bump(ref, tenant, "pins", +1)

    def unpin(self, ref: str, tenant: str) -> None:
        self._bump(ref, tenant, "pins", -1)

    def add_ref(self, ref: str, tenant: str, holder: str | None = None) -> None:
        """Take a reference on the blob (GC never collects a referenced blob). With `holder` (who holds it: a
        session, `holder_of(tenant, session_id)`), the reference is the holder's, one per (blob, holder): taking it
        again changes nothing, so a call retried after a lost reply or a store that failed half-way counts exactly
        once. Without, each call counts one more (held by no one in particular).

        Raises:
            NotFound: no such blob (collected, or never stored).
        """
        if holder is None:
            self._bump(ref, tenant, "refs", +1)
        else:
            self._hold(ref, tenant, holder, +1)

    def drop_ref(self, ref: str, tenant: str, holder: str | None = None) -> None:
        """Give back a reference add_ref took (with the same `holder`). With `holder`, giving back one the holder
        does not hold (given back already) changes nothing; without, FailedPrecondition when the blob has none."""
        if holder is None:
            self._bump(ref, tenant, "refs", -1)
        else:
            self._hold(ref, tenant, holder, -1)

    def held_refs(self, holder: str) -> list[tuple[str, str]]:
        """(ref, tenant) of each blob `holder` holds a reference on (add_ref with `holder`), in no order: what is
        left to give back when the holder's own list of them (a session's op log) is gone."""
        return self._held(check_key(holder))

    def _hold(self, ref: str, tenant: str, holder: str, delta: int) -> None:
        check_tenant(tenant)
        check_ref(ref)
        if self._hold_one(tenant, ref, check_key(holder), delta) is None:
            raise not_found(ref, tenant)

    def _bump(self, ref: str, tenant: str, counter: str, delta: int) -> None:
        check_tenant(tenant)
        check_ref(ref)
        result = self._incr(tenant, ref, counter, delta)
        if result is None:
            raise not_found(ref, tenant)
        if result < 0:
            from fleet.core.errors import FailedPrecondition  # noqa: PLC0415

            raise FailedPrecondition(f"blob {ref}: {counter} is already 0 for tenant {tenant!r}")

    def set_verdict(self, ref: str, tenant: str, verdict: str, reasons: list[str]) -> None:
        """Record a quarantine verdict (UNKNOWN, CLEAN or QUARANTINED) with its reasons."""
        check_tenant(tenant)
        check_ref(ref)
        if verdict not in VERDICTS:
            raise InvalidArgument(f"invalid verdict {verdict!r}: expected one of {', '.join(VERDICTS)}")
        if not isinstance(reasons, list | tuple) or not all(isinstance(r, str) for r in reasons):
            raise InvalidArgument("reasons must be a list of str")
        if not self._set_verdict(tenant, ref, verdict, json.dumps(list(reasons))):
            raise not_found(ref, tenant)

    def gc(self, now: float | None = None) -> int:
        """Delete unpinned, unreferenced blobs whose lease ran out; return how many were deleted."""
        return self._gc(self.cfg.clock() if now is None else float(now))

    # ---- controller state (global) -------------------------------------------------------------
    def kv_put(self, namespace: str, key: str, value: bytes) -> None:
        check_name("namespace", namespace)
        check_key(key)
        self._kv_put(namespace, key, bytes(check_bytes("value", value)))

    def kv_get(self, namespace: str, key: str) -> bytes | None:
        return self._kv_get(check_name("namespace", namespace), check_key(key))

    def kv_get_many(self, namespace: str, keys: Sequence[str]) -> list[bytes | None]:
        """kv_get of each key, in order: one round trip where the backend can."""
        check_name("namespace", namespace)
        for key in keys:
            check_key(key)
        return self._kv_get_many(namespace, list(keys))

    def kv_scan(self, namespace: str) -> dict[str, bytes]:
        return self._kv_scan(check_name("namespace", namespace))

    def kv_delete(self, namespace: str, key: str) -> None:
        self._kv_delete(check_name("namespace", namespace), check_key(key))

    def kv_scan_page(self, namespace: str, cursor: str = "", count: int = 500) -> tuple[str, dict[str, bytes]]:
        """One page of a namespace: (the cursor of the next page, about `count` of its entries).

        Start with cursor ""; a returned "" means the walk is over. The cursor is the backend's own (a key on
        SQLite, an HSCAN cursor on Redis): pass back only what a call returned. An entry present for the whole
        walk is returned at least once (Redis may return one twice); the walk never holds the store between
        pages, so a huge namespace is read in bounded steps (kv_scan reads it all at once).
        """
        check_name("namespace", namespace)
        if not isinstance(cursor, str) or len(cursor) > 1024 or not cursor.isprintable():
            raise InvalidArgument(f"invalid cursor {cursor!r}: pass back what kv_scan_page returned")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_KV_PAGE:
            raise InvalidArgument(f"invalid count {count!r}: expected 1-{MAX_KV_PAGE}")
        return self._kv_scan_page(namespace, cursor, count)

    def kv_delete_many(self, namespace: str, keys: Iterable[str]) -> None:
        """Delete `keys` (absent ones are skipped) in one transaction (SQLite) or one HDEL (Redis)."""
        check_name("namespace", namespace)
        if isinstance(keys, str):
            raise InvalidArgument("kv_delete_many takes a list of keys, not one str")
        checked = [check_key(k) for k in keys]
        if len(checked) > MAX_KV_PAGE:
            raise InvalidArgument(f"{len(checked)} keys in one kv_delete_many; at most {MAX_KV_PAGE}")
        if checked:
            self._kv_delete_many(namespace, checked)

    def kv_swap(self, namespace: str, key: str, old: bytes | None, new: bytes | None) -> bool:
        """Compare-and-set: write `new` (None: delete the key) only while the key holds `old` exactly (None:
        while it is absent), in one transaction/script; returns whether it wrote. Writers in several processes
        (two controllers overlapping during a leader change) each see whether another changed the key first.
        """
        check_name("namespace", namespace)
        check_key(key)
        return self._kv_swap(namespace, key, None if old is None else bytes(check_bytes("old", old)),
                             None if new is None else bytes(check_bytes("new", new)))

    # ---- op log (per tenant, per session) ------------------------------------------------------
    def oplog_append(self, tenant: str, session_id: str, op: dict[str, Any]) -> int:
        """Append one op (JSON) durably and return its 0-based index. Call before acknowledging."""
        check_tenant(tenant)
        check_name("session_id", session_id)
        return self._oplog_append(tenant, session_id, encode_op(op))

    def oplog_read(self, tenant: str, session_id: str) -> list[dict[str, Any]]:
        check_tenant(tenant)
        check_name("session_id", session_id)
        return [json.loads(s) for s in self._oplog_read(tenant, session_id)]

    def oplog_delete(self, tenant: str, session_id: str) -> bool:
        """Delete the session's log; whether there was one (of two deletes of a log, one answers True)."""
        check_tenant(tenant)
        check_name("session_id", session_id)
        return self._oplog_delete(tenant, session_id)

    def oplog_replace(self, tenant: str, session_id: str, ops: list[dict[str, Any]]) -> None:
        """Make `ops` the session's whole log (indices 0..n-1), in one write: a fork's copy of its parent's
        log. Every op is encoded (and refused if bad) before anything is written."""
        check_tenant(tenant)
        check_name("session_id", session_id)
        self._oplog_replace(tenant, session_id, [encode_op(op) for op in ops])

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the store must not be used afterwards."""

    def __enter__(self) -> BlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers --------------------------------------------------------------------------------
    def _check_size(self, size: int) -> None:
        limit = self.cfg.max_blob_bytes
        if size > limit:
            raise ResourceExhausted(
                f"blob exceeds the size limit: {size} bytes > max_blob_bytes={limit}; "
                "split the tool result or raise max_blob_bytes when opening the store"
            )

    @staticmethod
    def _check_expected(ref: str, expected_ref: str | None) -> None:
        if expected_ref is not None and ref != expected_ref:
            raise InvalidArgument(f"hash mismatch: expected_ref {expected_ref} but the bytes hash to {ref}")

    def _lease(self, now: float) -> float:
        return now + self.cfg.lease_s

    # ---- backend primitives ----------------------------------------------------------------------
    @abstractmethod
    def _put(self, tenant: str, ref: str, data: memoryview, now: float, quota: int) -> int | tuple[int, int] | None:
        """Store the blob, or only extend its lease if present. A new blob adds `blob_charge(data.nbytes)`
        to the tenant's stored bytes, and records it so that GC gives back exactly that. With quota > 0,
        a NEW blob that would take the tenant's stored bytes past quota is not written and the stored
        bytes are returned (with the bytes of the tenant's puts in progress, as a pair, where the backend
        counts them: Redis); otherwise None. Check and write are one transaction/script."""
    @abstractmethod
    def _stored_bytes(self, tenant: str) -> int: ...
    @abstractmethod
    def _get(self, tenant: str, ref: str) -> bytes | None: ...
    @abstractmethod
    def _get_range(self, tenant: str, ref: str, start: int, length: int) -> bytes | None: ...
    @abstractmethod
    def _stat(self, tenant: str, ref: str) -> BlobMeta | None: ...
    @abstractmethod
    def _incr(self, tenant: str, ref: str, counter: str, delta: int) -> int | None:
        """Apply delta unless it would go below 0; return the new value, -1 if refused, None if missing."""
    @abstractmethod
    def _hold_one(self, tenant: str, ref: str, holder: str, delta: int) -> int | None:
        """+1: add `holder` to the blob's holders, -1: remove it; `refs` moves only when the holders changed. One
        transaction/script, which also keeps the holder's list of its blobs. Returns `refs` after it, None if the blob
        is missing (then, for -1, the holder's list forgets it)."""
    @abstractmethod
    def _held(self, holder: str) -> list[tuple[str, str]]: ...
    @abstractmethod
    def _set_verdict(self, tenant: str, ref: str, verdict: str, reasons_json: str) -> bool: ...
    @abstractmethod
    def _gc(self, now: float) -> int: ...
    @abstractmethod
    def _kv_put(self, namespace: str, key: str, value: bytes) -> None: ...
    @abstractmethod
    def _kv_get(self, namespace: str, key: str) -> bytes | None: ...

    def _kv_get_many(self, namespace: str, keys: list[str]) -> list[bytes | None]:
        return [self._kv_get(namespace, key) for key in keys]  # a backend that can read them at once overrides it

    def _stat_many(self, tenant: str, refs: list[str]) -> list[BlobMeta | None]:
        return [self._stat(tenant, ref) for ref in refs]  # likewise
    @abstractmethod
    def _kv_scan(self, namespace: str) -> dict[str, bytes]: ...
    @abstractmethod
    def _kv_delete(self, namespace: str, key: str) -> None: ...
    @abstractmethod
    def _kv_scan_page(self, namespace: str, cursor: str, count: int) -> tuple[str, dict[str, bytes]]: ...
    @abstractmethod
    def _kv_delete_many(self, namespace: str, keys: list[str]) -> None: ...
    @abstractmethod
    def _kv_swap(self, namespace: str, key: str, old: bytes | None, new: bytes | None) -> bool: ...
    @abstractmethod
    def _oplog_append(self, tenant: str, session_id: str, op_json: str) -> int: ...
    @abstractmethod
    def _oplog_read(self, tenant: str, session_id: str) -> list[str]: ...
    @abstractmethod
    def _oplog_delete(self, tenant: str, session_id: str) -> bool: ...
    @abstractmethod
    def _oplog_replace(self, tenant: str, session_id: str, ops_json: list[str]) -> None: ...
