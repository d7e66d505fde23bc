"""Verdict cache: the same bytes under the same detector config get the same verdict, fleet-wide, per tenant.

Pure: it talks to any store-like object with `kv_get(namespace, key)` / `kv_put(namespace, key, value)`
(`fleet.cas.BlobStore`, SQLite or Redis). The key is the tenant, the bytes' SHA-256 and the detector's
config id, so a tenant whose config differs (another threshold, another rule set, another model) never
reads a verdict computed under someone else's policy, and no tenant ever reads a verdict another tenant's
bytes produced (issue #28: a shared entry answered in 111 ms where a miss took 600 ms, so one tenant could
test whether another's tool result held a given text):

    kv  namespace "quarantine.verdicts/<tenant>"   key "<sha256 hex>:<config_id>"   value JSON Verdict + "used"
        namespace "quarantine.verdicts.tenants"  key "<tenant>"  b"": the tenants that have a verdict space (the GC's)
        namespace "quarantine.verdicts"          key "<sha256 hex>:<config_id>" when no tenant is given (one-tenant
                                                 use); "<tenant>/<sha256 hex>:<config_id>": the layout before, read by
                                                 nobody, pruned by the GC until it is empty

A tenant's space holds at most `max_entries` verdicts (--max-verdicts-per-tenant): at the bound a new verdict is
answered and not cached (`num_not_cached`, `on_not_cached("tenant_bound")`), so one tenant judging distinct texts
fills its own space, never the store every tenant writes to. The count is the store's (`kv_len`, O(1)) and the
check is in the write's own transaction or script (`kv_put_bounded`): concurrent writers never pass it.

"used" is the entry's last use: set when it is written, moved by a hit at most once per TOUCH_INTERVAL_S
(not a write per hit). `prune` (the leader's store GC) deletes entries idle past a TTL, a bounded number of
rows per call: tool results are nearly all distinct, so without it every one left a row for good.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from fleet.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from fleet.core.quarantine.detector import Verdict

log = logging.getLogger(__name__)

NAMESPACE = "quarantine.verdicts"
TENANTS_SUFFIX = ".tenants"  # NAMESPACE + it: the index of the tenants' verdict spaces
TENANT_BOUND = "tenant_bound"  # why a verdict was not cached: its tenant's space held max_entries
TOUCH_INTERVAL_S = 3600.0  # a hit rewrites its entry's "used" when it is at least this old
REINDEX_S = 300.0  # TenantIndex: a tenant is written to its index again at most this often by one process
PRUNE_PAGE, PRUNE_ROWS = 500, 50_000  # `prune`: rows per store call, rows looked at per call of it


class KVStore(Protocol):
    def kv_get(self, namespace: str, key: str) -> bytes | None: ...
    def kv_get_many(self, namespace: str, keys: Sequence[str]) -> list[bytes | None]: ...
    def kv_put(self, namespace: str, key: str, value: bytes) -> None: ...
    def kv_put_bounded(self, namespace: str, key: str, value: bytes, max_keys: int) -> bool: ...
    def kv_len(self, namespace: str) -> int: ...
    def kv_scan(self, namespace: str) -> dict[str, bytes]: ...


class PagedKVStore(KVStore, Protocol):
    def kv_scan_page(self, namespace: str, cursor: str, count: int) -> tuple[str, dict[str, bytes]]: ...
    def kv_delete_many(self, namespace: str, keys: list[str]) -> None: ...


class ConfiguredDetector(Protocol):
    """A detector with a stable `config_id` (e.g. `LayeredDetector`)."""

    config_id: str

    def inspect(self, text: str | bytes | bytearray | memoryview) -> Verdict: ...


class TenantIndex:
    """The tenants that have a space of entries under a prefix (the GC walks theirs), kept in kv namespace `namespace`.

    A tenant is written there before this process's first entry for it, and again when it last wrote it REINDEX_S
    ago: one write per tenant per REINDEX_S, not one per entry. NOTE: the verdict cache wrote it once per process and
    the quarantine records before every new record; once per process, an index the store lost (a flush) was never
    written again, and the GC never found the entries written since (they were never pruned)."""

    def __init__(self, store: KVStore, namespace: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.namespace, self.clock = store, namespace, clock
        self._written: dict[str, float] = {}  # tenant -> when this process last wrote it (one per tenant)

    def note(self, tenant: str) -> None:
        """`tenant` is about to write an entry of its space."""
        now, at = self.clock(), self._written.get(tenant)
        if at is None or now - at >= REINDEX_S:
            self.store.kv_put(self.namespace, tenant, b"")
            self._written[tenant] = now


class VerdictCache:
    """Memoises `detector.inspect` in `store`'s kv space, keyed by tenant + sha256(bytes) + detector config id."""

    def __init__(self, store: KVStore, detector: ConfiguredDetector, namespace: str = NAMESPACE,
                 config_id: str | None = None, clock: Callable[[], float] | None = None,
                 max_entries: int | None = None, on_not_cached: Callable[[str], None] | None = None) -> None:
        """config_id: the verdict space (default: the detector's own; a caller may name more, e.g. the code).
        clock: the time an entry is used at (default time.time), injectable for tests. max_entries: the most
        verdicts one tenant's space holds (None: no bound); on_not_cached(reason) is called for each one not cached."""
        if max_entries is not None and (isinstance(max_entries, bool) or not isinstance(max_entries, int)
                                        or max_entries < 1):
            raise InvalidArgument(f"max_entries {max_entries!r}: expected an int >= 1 (None: no bound)")
        self.store, self.detector, self.namespace = store, detector, namespace
        self.config_id = detector.config_id if config_id is None else config_id
        self.clock, self.max_entries, self.on_not_cached = clock, max_entries, on_not_cached
        self.num_hits = self.num_misses = 0
        self.num_touch_failures = 0  # hits answered whose last-use touch the store refused
        self.num_not_cached = 0  # verdicts answered and not cached: the tenant's space held max_entries
        self.index = TenantIndex(store, f"{namespace}{TENANTS_SUFFIX}")  # the tenants' spaces, for the GC

    def _now(self) -> float:
        return time.time() if self.clock is None else self.clock()

    def ns(self, tenant: str | None = None) -> str:
        """The namespace of `tenant`'s verdicts (None: the unscoped one); tenant names hold no '/'."""
        return self.namespace if tenant is None else f"{self.namespace}/{tenant}"

    def key(self, data: bytes | bytearray | memoryview) -> str:
        """The store key of `data`'s verdict in a tenant's namespace (`ns(tenant)`: the key is the same in each)."""
        return self.ref_key(hashlib.sha256(data).hexdigest())

    def ref_key(self, ref: str) -> str:
        """The store key of the verdict on the bytes whose sha256 hex is `ref`."""
        return f"{ref}:{self.config_id}"

    def has_room(self, tenant: str | None = None) -> bool:
        """Whether `tenant`'s space holds fewer than max_entries verdicts (one O(1) store call), so a verdict
        computed now would be cached."""
        return self.max_entries is None or self.store.kv_len(self.ns(tenant)) < self.max_entries

    def cached(self, data: bytes | bytearray | memoryview, tenant: str | None = None) -> Verdict | None:
        """The stored verdict for `data` in `tenant`'s space, or None; inspects nothing, counts nothing
        (a hit is a use all the same: it keeps the entry from being pruned)."""
        ns, key = self.ns(tenant), self.key(data)
        raw = self.store.kv_get(ns, key)
        return None if raw is None else self._hit(ns, key, raw)

    def inspect(self, data: bytes | bytearray | memoryview, tenant: str | None = None) -> Verdict:
        """The cached verdict for `data`, or the detector's (then stored).

        Args:
            data: the tool result's bytes (the blob, exactly as stored).
            tenant: whose verdict space: a verdict is only ever read back by the tenant whose bytes made
                it (None: one space for every caller, for one-tenant use).

        Returns:
            The Verdict; equal to `detector.inspect(data)` for the same bytes and config.
        """
        ns, key = self.ns(tenant), self.key(data)
        raw = self.store.kv_get(ns, key)
        if raw is not None:
            self.num_hits += 1
            return self._hit(ns, key, raw)
        self.num_misses += 1
        v = self.detector.inspect(data)
        if not self._put(ns, key, verdict_to_json(v, used=self._now()), tenant):
            self.num_not_cached += 1
            if self.on_not_cached is not None:
                self.on_not_cached(TENANT_BOUND)
        return v

    def _put(self, ns: str, key: str, value: bytes, tenant: str | None) -> bool:
        """Write one entry, within the bound; False: the space held max_entries and `key` was not among them."""
        if tenant is not None:
            self.index.note(tenant)  # before its entry: none outside the index
        if self.max_entries is None:
            self.store.kv_put(ns, key, value)
            return True
        return self.store.kv_put_bounded(ns, key, value, self.max_entries)

    def _hit(self, ns: str, key: str, raw: bytes) -> Verdict:
        """The verdict in `raw`; its "used" moved to now if it is TOUCH_INTERVAL_S old (or missing)."""
        doc = json.loads(raw)
        now, used = self._now(), doc.get("used")
        if not isinstance(used, int | float) or now - used >= TOUCH_INTERVAL_S:
            # NOTE: best-effort: a store refusing writes (Redis at maxmemory, SQLite behind a long write) failed the
            # read of a verdict it holds; untouched, the entry is touched by a later hit, or pruned and judged again
            try:
                self._put(ns, key, json.dumps({**doc, "used": now}, sort_keys=True).encode(), None)
            except (Unavailable, ResourceExhausted) as e:
                self.num_touch_failures += 1
                log.debug("verdict cache: the last-use touch of %s was not written: %s", key, e)
        return _verdict_of(doc)


class PruneResult(NamedTuple):
    """One `prune` call: where the next one goes on ("": from the start), rows looked at, rows deleted."""

    cursor: str
    num_seen: int
    num_pruned: int


def prune(store: PagedKVStore, now: float, ttl_s: float, quarantined_ttl_s: float, cursor: str = "",
          max_rows: int = PRUNE_ROWS, namespace: str = NAMESPACE) -> PruneResult:
    """Delete the verdicts (every tenant's, every config's) whose last use is more than `ttl_s` before `now`
    (`quarantined_ttl_s` for a QUARANTINED one), and any without a last use or that cannot be read.

    The spaces walked: `namespace` itself (the unscoped verdicts, and the layout before per-tenant spaces, until it
    is empty), then each tenant's in the index, in name order. Bounded: it reads from `cursor` in pages of
    PRUNE_PAGE rows (one store call each, the store free between them) and stops after about `max_rows`, or at the
    end of the last space; the caller passes the returned cursor to the next call. An entry without "used" was
    written before it was recorded, so under another code digest (this module is part of it): no Judge reads it.

    Returns:
        PruneResult(cursor for the next call, rows looked at, rows deleted).
    """
    spaces = [namespace, *(f"{namespace}/{t}" for t in sorted(store.kv_scan(f"{namespace}{TENANTS_SUFFIX}")))]
    space, _, inner = cursor.partition("\n")
    i = spaces.index(space) if space in spaces else 0  # a cursor of another walk (or of the layout before): restart
    inner = inner if space in spaces else ""
    num_seen = num_pruned = 0
    while True:
        inner, rows = store.kv_scan_page(spaces[i], inner, PRUNE_PAGE)
        idle = [k for k, raw in rows.items() if _idle(raw, now, ttl_s, quarantined_ttl_s)]
        if idle:
            store.kv_delete_many(spaces[i], idle)
        num_seen, num_pruned = num_seen + len(rows), num_pruned + len(idle)
        if not inner:
            i += 1
            if i == len(spaces):
                return PruneResult("", num_seen, num_pruned)
        if num_seen >= max_rows:
            return PruneResult(f"{spaces[i]}\n{inner}", num_seen, num_pruned)


def _idle(raw: bytes, now: float, ttl_s: float, quarantined_ttl_s: float) -> bool:
    try:
        doc = json.loads(raw)
        used, quarantined = float(doc["used"]), bool(doc["quarantined"])
    except (ValueError, KeyError, TypeError):
        return True  # no last use, or damaged (it would fail every read)
    return now - used > (quarantined_ttl_s if quarantined else ttl_s)


def verdict_to_json(v: Verdict, used: float | None = None) -> bytes:
    doc: dict[str, Any] = {
        "quarantined": v.quarantined,
        "reasons": v.reasons,
        "score": v.score,
        "learned_score": v.learned_score,
        "encoder_score": v.encoder_score,
    }
    if used is not None:
        doc["used"] = used
    return json.dumps(doc, sort_keys=True).encode()


def verdict_from_json(raw: bytes) -> Verdict:
    return _verdict_of(json.loads(raw))


def _verdict_of(d: dict[str, Any]) -> Verdict:
    return Verdict(
        bool(d["quarantined"]),
        list(d["reasons"]),
        float(d["score"]),
        None if d["learned_score"] is None else float(d["learned_score"]),
        None if d.get("encoder_score") is None else float(d["encoder_score"]),  # absent before the encoder layer
    )
