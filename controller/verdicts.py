"""Judge: tool-result verdicts for the proxy, kept in the store so every proxy and controller agree.

Both the proxy (JudgeToolResults) and sessions (AdmitToolResult, `Judge.admission`) ask it, so the
controller's --detector-layers is the one policy, loaded once per controller, never in a kernel host.

    verdict(bytes) = operator verdict on sha256(bytes), if one is set        (late verdicts, SetVerdict)
                   else QUARANTINED if the tenant's blob of these bytes is   (admit_tool_result marked it)
                   else the tenant's full verdict, if the store has it       (every layer, the heavy ones too)
                   else the tenant's fast verdict (layers not in HEAVY_LAYERS, computed now if need be),
                        and the full one is computed in the background (`heavy`): a late verdict, unless
                        the config's encoder gate keeps the encoder off these bytes (the learned score is
                        below it): then the fast verdict is the full one and nothing is queued

A config with only heavy layers has no fast verdict and is judged in full at once (`judge` does the
whole rule inline: tests, scripts). docs/quarantine_path.md states the policy.

Store layout (kv space; fleet.cas.BlobStore, SQLite or Redis):

    quarantine.verdicts/<tenant>  "<sha256>:<config id>.<code>"  JSON Verdict, "used" (fleet.core.quarantine.cache)
    quarantine.operator  "<sha256>"                       {"verdict","reasons","at"}
    quarantine.seen/<tenant>  "<sha256>"                  QuarantineRecord as JSON (recent quarantines, per tenant:
                                                          controller/quarantine_records.py)

Verdicts are cached per tenant (issue #28): a tenant never reads a verdict another tenant's bytes made. A tenant's
verdicts, and its records, are each bounded (`max_verdicts`, --max-verdicts-per-tenant): past it they are answered
and not stored, and a tenant whose verdict space is full is judged in full at once (below, `now`), since its heavy
layer's verdict could not be kept for its next request.
Blocking (store I/O, the detector's CPU): the servicers run these methods in the tenant's judge lane
(controller/judge_lanes.py), never on the event loop or the store executor.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import fleet.core.quarantine as quarantine_pkg
from controller.quarantine_records import TENANTS_NS, recent, record
from fleet.core.errors import InvalidArgument, NotFound
from fleet.core.quarantine import DetectorConfig, VerdictCache, make_detector
from fleet.core.quarantine.cache import TENANT_BOUND, TenantIndex
from fleet.core.quarantine.layered import gate_reason, gated_out
from fleet.core.verdict import CLEAN, OPERATOR_NS, QUARANTINED
from fleet.sdk.quarantine import Judgement, QuarantineRecord  # the types the SDK answers with

ACTIONS = ("placeholder", "refuse")
MAX_RESULTS = 256  # tool results per JudgeToolResults call
MAX_REFS = 1024  # refs per KnownVerdicts call
MAX_REASONS, MAX_REASON_LEN = 16, 200
HEAVY_LAYERS = frozenset({"encoder"})  # run off the request path when the config has a faster layer too


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def detector_code_digest() -> str:
    """sha256 (12 hex) of the fleet.core.quarantine package's source files, subpackages included.

    Deterministic across processes and machines: files in order of their package-relative POSIX path, line
    endings as LF (a CRLF checkout judges like an LF one). Judge computes it once, at start.
    NOTE: a detector's config_id covers its config and model weights, not its rules' code; folding this in
    makes a rule update a new verdict space, so bytes judged clean before it are judged again (a late verdict).
    Any edit to a .py file of the package counts, even one that changes no verdict: the cache starts afresh.
    """
    root = Path(quarantine_pkg.__file__).parent
    h = hashlib.sha256()
    for rel in sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()[:12]


class Judge:
    """Verdicts on tool results' bytes; the detector defaults to the shipped policy, DetectorConfig(), and a
    tenant named in `tenants` gets its own (its own verdict space: another config id)."""

    def __init__(self, store: Any, config: DetectorConfig | None = None,
                 tenants: Mapping[str, DetectorConfig] | None = None, max_verdicts: int | None = None,
                 on_not_stored: Callable[[str, str], None] | None = None) -> None:
        """max_verdicts: the most cached verdicts, and the most quarantine records, one tenant keeps in the store
        (None: no bound); on_not_stored(kind, reason) is called for each one not stored (kind "verdict", "record")."""
        self.store, self.max_verdicts = store, max_verdicts
        self._records_index = TenantIndex(store, TENANTS_NS)  # the tenants with quarantine records, for the GC
        self._not_stored = on_not_stored or (lambda kind, reason: None)
        code = detector_code_digest()  # the verdict space names the code that judges too
        caches: dict[DetectorConfig, VerdictCache] = {}

        def cache_of(cfg: DetectorConfig) -> VerdictCache:
            if cfg not in caches:  # tenants with equal configs share one detector (and the models are shared)
                det = make_detector(cfg)
                caches[cfg] = VerdictCache(store, det, config_id=f"{det.config_id}.{code}", max_entries=max_verdicts,
                                           on_not_cached=lambda reason: self._not_stored("verdict", reason))
            return caches[cfg]

        def fast_of(cfg: DetectorConfig) -> VerdictCache | None:
            fast = tuple(x for x in cfg.layers if x not in HEAVY_LAYERS)
            # the gates decide what the heavy layer reads, not the fast verdict: gated or not, one fast space
            fast_cfg = replace(cfg, layers=fast, encoder_gate=None, encoder_max_fragmentation=None)
            return cache_of(fast_cfg) if fast and fast != cfg.layers else None

        default = config or DetectorConfig()
        self.config, self.tenant_configs = default, dict(tenants or {})
        self.cache = cache_of(default)  # the shipped policy, every layer
        self.tenant_caches = {t: cache_of(c) for t, c in (tenants or {}).items()}
        self.fast = fast_of(default)  # its fast layers (None: it has no heavy layer, or only heavy ones)
        self.tenant_fast = {t: fast_of(c) for t, c in (tenants or {}).items()}

    @property
    def config_id(self) -> str:
        """The default detector's verdict space."""
        return self.cache.config_id

    def cache_for(self, tenant: str) -> VerdictCache:
        """`tenant`'s full verdicts (every layer of its config)."""
        return self.tenant_caches.get(tenant, self.cache)

    def fast_for(self, tenant: str) -> VerdictCache | None:
        """`tenant`'s fast verdicts (its config without HEAVY_LAYERS), or None: nothing to run later."""
        return self.tenant_fast[tenant] if tenant in self.tenant_fast else self.fast

    def config_id_for(self, tenant: str) -> str:
        """The verdict space `tenant`'s results are judged in."""
        return self.cache_for(tenant).config_id

    def judge(self, results: list[bytes], tenant: str, action: str) -> list[Judgement]:
        """One Judgement per result, in order; quarantined ones are recorded for `tenant`.

        Raises:
            InvalidArgument: too many results, or an action other than ACTIONS.
        """
        self.check(len(results), action)
        out = [self._one(data, tenant) for data in results]
        self.record(tenant, out, action)
        return out

    @staticmethod
    def check(num_results: int, action: str) -> None:
        """Raises InvalidArgument: too many results in one call, or an action other than ACTIONS."""
        if num_results > MAX_RESULTS:
            raise InvalidArgument(f"{num_results} tool results in one call; at most {MAX_RESULTS}")
        if action not in ACTIONS:
            raise InvalidArgument(f"action {action!r}: expected one of {ACTIONS}")

    def admission(self, ref: str, tenant: str, fast: bool = False) -> tuple[Judgement, bool]:
        """The verdict on the tenant's stored blob `ref` for AdmitToolResult: the same rule, detector and
        verdict cache as the proxy's (so a session and the proxy agree on the same bytes, and bytes judged
        once are not judged again); a quarantine is recorded for the tenant with action "evict". With
        `fast`, (the fast verdict, whether the full verdict is still to come: `heavy_blob`).

        Raises:
            NotFound: the tenant has no blob `ref`.
        """
        data = bytes(self.store.get(ref, tenant))
        j, later = self.now(data, tenant, fast)
        if j.quarantined:
            self._record(tenant, j, "evict", time.time())
        return j, later

    def _one(self, data: bytes, tenant: str) -> Judgement:
        j, _ = self.now(data, tenant, fast=False)
        return j

    def now(self, data: bytes, tenant: str, fast: bool = True) -> tuple[Judgement, bool]:
        """(the verdict a request gets now, whether the full verdict is still to come: run `heavy` later).

        fast=False: the full verdict, computed now if need be (the second element is then False). A tenant whose
        verdict space is full gets the full verdict now too: the heavy layer's, computed later, could not be cached,
        so its next request would get the fast verdict again, and a late QUARANTINED would never be enforced.
        """
        ref = sha256_hex(data)
        raw = self.store.kv_get(OPERATOR_NS, ref)
        if raw is not None:
            op = json.loads(raw)
            return Judgement(ref, op["verdict"] == QUARANTINED, tuple(op["reasons"]), "operator"), False
        blob = self._blob_verdict(ref, tenant)
        if blob is not None:
            return blob, False
        full, quick = self.cache_for(tenant), self.fast_for(tenant)
        if fast and quick is not None:
            v = full.cached(data, tenant)
            if v is None:
                v = quick.inspect(data, tenant)
                cfg = self.tenant_configs.get(tenant, self.config)
                if not v.quarantined and gated_out(cfg, v.learned_score):  # the heavy layer will not run: final
                    return Judgement(ref, False, (*v.reasons, gate_reason(cfg)), "detector"), False
                if v.quarantined or full.has_room(tenant):
                    return Judgement(ref, v.quarantined, tuple(v.reasons), "detector"), not v.quarantined
                v = full.inspect(data, tenant)  # at its bound: the full verdict now (its own lane's CPU)
        else:
            v = full.inspect(data, tenant)
        return Judgement(ref, v.quarantined, tuple(v.reasons), "detector"), False

    def known(self, refs: list[str], tenant: str) -> list[Judgement]:
        """The verdict known now on each ref for `tenant`, without its bytes: the operator's, then the tenant's
        blob, then the tenant's stored full or fast verdict (a heavy layer's late one among them); not
        quarantined where none says so. Nothing is inspected or recorded (KnownVerdicts: the proxy checks the
        tool results a stored response carries, docs/proxy.md).

        Raises:
            InvalidArgument: too many refs, or one that is not a SHA-256 in hex.
        """
        if len(refs) > MAX_REFS:
            raise InvalidArgument(f"{len(refs)} refs in one call; at most {MAX_REFS}")
        for ref in refs:
            _check_ref(ref)
        # NOTE: each source read for every ref at once (one round trip each on Redis): one read per ref and source
        # took ~0.1 ms apiece, so a chain of 1,000 digests added 191 ms to its follow-up's first byte
        out: list[Judgement | None] = [None] * len(refs)
        for i, raw in enumerate(self.store.kv_get_many(OPERATOR_NS, refs)):
            if raw is not None:
                op = json.loads(raw)
                out[i] = Judgement(refs[i], op["verdict"] == QUARANTINED, tuple(op["reasons"]), "operator")
        left = [i for i, j in enumerate(out) if j is None]
        for i, meta in zip(left, self.store.stat_many([refs[i] for i in left], tenant), strict=True):
            if meta is not None and meta.verdict == QUARANTINED:
                out[i] = Judgement(refs[i], True, tuple(meta.reasons), "blob")
        for cache in (self.cache_for(tenant), self.fast_for(tenant)):
            left = [i for i, j in enumerate(out) if j is None]
            if cache is None or not left:
                continue
            keys = [cache.ref_key(refs[i]) for i in left]
            for i, got in zip(left, cache.store.kv_get_many(cache.ns(tenant), keys), strict=True):
                doc = json.loads(got) if got is not None else None
                if doc is not None and doc.get("quarantined"):
                    out[i] = Judgement(refs[i], True, tuple(doc.get("reasons", ())), "detector")
        return [j if j is not None else Judgement(r, False, (), "detector") for r, j in zip(refs, out, strict=True)]

    def heavy(self, data: bytes, tenant: str) -> Judgement:
        """The full verdict (every layer), stored in the tenant's verdict space; a quarantine found late is
        recorded for the tenant (action "late") and marks the tenant's blob of these bytes, if it has one, so
        sessions refuse to append it and the next AdmitToolResult evicts it (a late eviction)."""
        j = self._one(data, tenant)
        if j.quarantined and j.source == "detector":
            self._record(tenant, j, "late", time.time())
            try:
                self.store.set_verdict(j.ref, tenant, QUARANTINED, list(j.reasons))
            except NotFound:
                pass  # the proxy saw it; the tenant never stored it as a blob
        return j

    def heavy_blob(self, ref: str, tenant: str) -> Judgement | None:
        """`heavy` on the tenant's blob `ref` (None: it is gone), read when the job runs (PutBlob's hook:
        a queued job holds a ref, not the bytes)."""
        try:
            data = bytes(self.store.get(ref, tenant))
        except NotFound:
            return None
        return self.heavy(data, tenant)

    def record(self, tenant: str, out: list[Judgement], action: str) -> None:
        """Record `out`'s quarantined refs for `tenant` (ListQuarantines), once per ref."""
        now = time.time()
        for j in {j.ref: j for j in out if j.quarantined}.values():
            self._record(tenant, j, action, now)

    def _blob_verdict(self, ref: str, tenant: str) -> Judgement | None:
        """QUARANTINED if the tenant's own blob of these bytes was (admit_tool_result: one verdict, two media)."""
        try:
            meta = self.store.stat(ref, tenant)
        except NotFound:
            return None
        return Judgement(ref, True, tuple(meta.reasons), "blob") if meta.verdict == QUARANTINED else None

    def _record(self, tenant: str, j: Judgement, action: str, now: float) -> None:
        # in the tenant's own namespace (controller/quarantine_records.py), within its bound
        if not record(self.store, self._records_index, tenant, j, action, now, self.max_verdicts):
            self._not_stored("record", TENANT_BOUND)

    def set_verdict(self, ref: str, verdict: str, reasons: list[str]) -> None:
        """Set (or with verdict "" drop) the operator's verdict on the bytes whose sha256 is `ref`."""
        _check_ref(ref)
        if verdict == "":
            self.store.kv_delete(OPERATOR_NS, ref)
            return
        if verdict not in (QUARANTINED, CLEAN):
            raise InvalidArgument(f"verdict {verdict!r}: expected QUARANTINED, CLEAN, or '' to drop it")
        if len(reasons) > MAX_REASONS or any(len(r) > MAX_REASON_LEN for r in reasons):
            raise InvalidArgument(f"at most {MAX_REASONS} reasons of at most {MAX_REASON_LEN} characters")
        doc = {"verdict": verdict, "reasons": list(reasons) or ["operator"], "at": time.time()}
        self.store.kv_put(OPERATOR_NS, ref, json.dumps(doc).encode())

    def recent(self, tenant: str | None, limit: int) -> list[QuarantineRecord]:
        """Quarantine records of `tenant` (None: every tenant), most recently seen first, at most `limit`; a tenant's
        listing reads its own records alone (controller/quarantine_records.py)."""
        return recent(self.store, tenant, limit)


def _check_ref(ref: str) -> None:
    if len(ref) != 64 or any(c not in "0123456789abcdef" for c in ref):
        raise InvalidArgument(f"ref {ref[:80]!r}: expected the 64 lowercase hex digits of the bytes' SHA-256")
