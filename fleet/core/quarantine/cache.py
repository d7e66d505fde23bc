"""Verdict cache: the same bytes under the same detector config get the same verdict, fleet-wide, per tenant.

Pure: it talks to any store-like object with `kv_get(namespace, key)` / `kv_put(namespace, key, value)`
(`fleet.cas.BlobStore`, SQLite or Redis). The key is the tenant, the bytes' SHA-256 and the detector's
config id, so a tenant whose config differs (another threshold, another rule set, another model) never
reads a verdict computed under someone else's policy, and no tenant ever reads a verdict another tenant's
bytes produced (issue #28: a shared entry answered in 111 ms where a miss took 600 ms, so one tenant could
test whether another's tool result held a given text):

    kv  namespace "quarantine.verdicts"   key "<tenant>/<sha256 hex>:<config_id>"   value JSON Verdict
                                          ("<sha256 hex>:<config_id>" when no tenant is given: one-tenant use)
"""

from __future__ import annotations

import hashlib
import json
from typing import Protocol

from fleet.core.quarantine.detector import Verdict

NAMESPACE = "quarantine.verdicts"


class KVStore(Protocol):
    def kv_get(self, namespace: str, key: str) -> bytes | None: ...
    def kv_put(self, namespace: str, key: str, value: bytes) -> None: ...


class ConfiguredDetector(Protocol):
    """A detector with a stable `config_id` (e.g. `LayeredDetector`)."""

    config_id: str

    def inspect(self, text: str | bytes | bytearray | memoryview) -> Verdict: ...


class VerdictCache:
    """Memoises `detector.inspect` in `store`'s kv space, keyed by tenant + sha256(bytes) + detector config id."""

    def __init__(self, store: KVStore, detector: ConfiguredDetector, namespace: str = NAMESPACE,
                 config_id: str | None = None) -> None:
        """config_id: the verdict space (default: the detector's own; a caller may name more, e.g. the code)."""
        self.store, self.detector, self.namespace = store, detector, namespace
        self.config_id = detector.config_id if config_id is None else config_id
        self.num_hits = self.num_misses = 0

    def key(self, data: bytes | bytearray | memoryview, tenant: str | None = None) -> str:
        """The store key of `data`'s verdict in `tenant`'s verdict space (None: the unscoped one)."""
        digest = f"{hashlib.sha256(data).hexdigest()}:{self.config_id}"
        return digest if tenant is None else f"{tenant}/{digest}"

    def cached(self, data: bytes | bytearray | memoryview, tenant: str | None = None) -> Verdict | None:
        """The stored verdict for `data` in `tenant`'s space, or None; inspects nothing, counts nothing."""
        raw = self.store.kv_get(self.namespace, self.key(data, tenant))
        return None if raw is None else verdict_from_json(raw)

    def inspect(self, data: bytes | bytearray | memoryview, tenant: str | None = None) -> Verdict:
        """The cached verdict for `data`, or the detector's (then stored).

        Args:
            data: the tool result's bytes (the blob, exactly as stored).
            tenant: whose verdict space: a verdict is only ever read back by the tenant whose bytes made
                it (None: one space for every caller, for one-tenant use).

        Returns:
            The Verdict; equal to `detector.inspect(data)` for the same bytes and config.
        """
        key = self.key(data, tenant)
        raw = self.store.kv_get(self.namespace, key)
        if raw is not None:
            self.num_hits += 1
            return verdict_from_json(raw)
        self.num_misses += 1
        v = self.detector.inspect(data)
        self.store.kv_put(self.namespace, key, verdict_to_json(v))
        return v


def verdict_to_json(v: Verdict) -> bytes:
    doc = {
        "quarantined": v.quarantined,
        "reasons": v.reasons,
        "score": v.score,
        "learned_score": v.learned_score,
        "encoder_score": v.encoder_score,
    }
    return json.dumps(doc, sort_keys=True).encode()


def verdict_from_json(raw: bytes) -> Verdict:
    d = json.loads(raw)
    return Verdict(
        bool(d["quarantined"]),
        list(d["reasons"]),
        float(d["score"]),
        None if d["learned_score"] is None else float(d["learned_score"]),
        None if d.get("encoder_score") is None else float(d["encoder_score"]),  # absent before the encoder layer
    )
