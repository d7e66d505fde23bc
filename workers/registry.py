"""SessionRegistry: the store's record of every session of a fleet (the only code naming its namespace).

One JSON record per (tenant, session), written by the controller's KernelFleet and read by it and by
the sessions servicer counting a tenant's quota after a restart. It survives the controller:

    {"tenant": "acme", "session": "s1", "node": "<ray node id>", "state": "active", "epoch": 0,
     "created": 1733130000.0, "adopted_tokens": 32}
    (+ "parent", "moved_bytes" for a fork; "regenerated", "witness" once its actor was lost)

state: creating (not acknowledged yet: the session is absent) | active | idle (actor released,
log kept) | lost (actor gone, being regenerated).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

NAMESPACE = "kvfleet.sessions"
CREATING = "creating"


class RegistryStore(Protocol):
    """The part of a BlobStore (fleet.cas) the registry uses: its key-value namespace."""

    def kv_get(self, namespace: str, key: str) -> bytes | None: ...

    def kv_put(self, namespace: str, key: str, value: bytes) -> None: ...

    def kv_delete(self, namespace: str, key: str) -> None: ...

    def kv_scan(self, namespace: str) -> dict[str, bytes]: ...


class SessionRegistry:
    """The fleet's session records in `store`, keyed `{tenant}/{session}`."""

    def __init__(self, store: RegistryStore) -> None:
        self.store = store

    def get(self, tenant: str, session_id: str) -> dict[str, Any] | None:
        """The record, `creating` ones included; None when there is none."""
        raw = self.store.kv_get(NAMESPACE, _key(tenant, session_id))
        return None if raw is None else dict(json.loads(raw))

    def save(self, rec: dict[str, Any]) -> None:
        self.store.kv_put(NAMESPACE, _key(rec["tenant"], rec["session"]), json.dumps(rec).encode())

    def delete(self, tenant: str, session_id: str) -> None:
        self.store.kv_delete(NAMESPACE, _key(tenant, session_id))

    def records(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every record (of `tenant`, when given), `creating` ones included, in key order."""
        recs = [json.loads(raw) for _, raw in sorted(self.store.kv_scan(NAMESPACE).items())]
        return [r for r in recs if tenant is None or r["tenant"] == tenant]


def _key(tenant: str, session_id: str) -> str:
    return f"{tenant}/{session_id}"
