"""SessionRegistry: the store's record of every session of a fleet (the only code naming its namespace),
and SessionRecord, the one typed record of a session with its one state machine.

One JSON record per (tenant, session), written by the controller's KernelFleet and read by it and by
the sessions servicer counting a tenant's quota after a restart. It survives the controller:

    {"tenant": "acme", "session": "s1", "node": "<ray node id>", "state": "active", "epoch": 0,
     "created": 1733130000.0, "adopted_tokens": 32, "parent": "", "moved_bytes": 0, "regenerated": 0,
     "witness": null, "model_id": "3d4dba9effc419f3", "rebuilt_from_model_id": "",
     "create_op_id": "<the create's or fork's op id>"}

`model_id` is the kernel (weights, dtype, backend, CPU code path: `Kernel.model_id`) whose KV the session
holds: a rebuild is bit-identical only on a kernel of the same one. A rebuild that had to run on another
(no survivor had it) sets `rebuilt_from_model_id` to the one the session had. Records written before these
fields load with "" (unknown: no preference, nothing flagged).

Writers may overlap (threads of one KernelFleet, two controllers during a leader change), so a record is
changed only over the bytes its writer read (`insert`, `replace`, `remove`: the store's compare-and-set):
a create never writes over another's record, and a rebuild never brings back a record a close removed.

The state is the registry's alone (a kernel host reports what it holds, never a state); one vocabulary:

    creating ──acknowledged──▶ active ──released (idle TTL)──▶ idle
       │                         │                              │
       │ never acknowledged      │ its kernel lost              │ its next call
       ▼ (absent; cleared on     ▼ (host died, node gone)       ▼
         the next create)       lost ◀──────────────────────────┘
                                 │ rebuilt from its op log (epoch + 1 per loss)
                                 ▼
                            regenerated ── live, like active; the listing shows `lost` for a live
                                           record whose host does not hold the session
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

NAMESPACE = "kvfleet.sessions"
CREATING, ACTIVE, IDLE, LOST, REGENERATED = "creating", "active", "idle", "lost", "regenerated"
STATES = (CREATING, ACTIVE, IDLE, LOST, REGENERATED)


@dataclass(slots=True)
class SessionRecord:
    """A session as the registry holds it. Its methods are the only state transitions."""

    tenant: str
    session: str
    node: str
    state: str = CREATING
    epoch: int = 0
    created: float = dataclasses.field(default_factory=time.time)
    adopted_tokens: int = 0
    parent: str = ""
    moved_bytes: int = 0
    regenerated: int = 0
    witness: dict[str, Any] | None = None
    model_id: str = ""               # the kernel whose KV it holds ("" unknown: a record from before the field)
    rebuilt_from_model_id: str = ""  # set when a rebuild ran on a kernel of another model_id: the one it had
    create_op_id: str = ""  # the op id of the create or fork that made it (its first op or fork marker carries it)

    def __post_init__(self) -> None:
        assert self.state in STATES, self.state

    @property
    def live(self) -> bool:
        """Acknowledged and not released: a host should hold its kernel."""
        return self.state in (ACTIVE, REGENERATED)

    def acknowledged(self, adopted_tokens: int, moved_bytes: int = 0, model_id: str = "") -> None:
        assert self.state == CREATING, self.state
        self.state, self.adopted_tokens, self.moved_bytes = ACTIVE, adopted_tokens, moved_bytes
        self.model_id = model_id

    def released(self) -> None:
        assert self.live, self.state
        self.state = IDLE

    def lose(self) -> None:
        """Its kernel is gone: one loss, one epoch step (a rebuild that failed is retried at the same epoch)."""
        from fleet.core.lifecycle import Witness

        assert self.state != CREATING, self.state
        if self.state != LOST:
            self.epoch += 1
        self.state = LOST
        self.witness = Witness("actor_lost", "error", "forgotten", True, False, self.epoch).to_dict()

    def rebuilt(self, node: str, model_id: str = "") -> bool:
        """Rebuilt on `node` by a kernel of `model_id` ("": not said). Returns whether that kernel's model_id
        differs from the one the session had: its KV and logits are then close to, not bit-identical with,
        what was acknowledged, and `rebuilt_from_model_id` keeps the one it had."""
        assert self.state == LOST, self.state
        self.state, self.node, self.regenerated = REGENERATED, node, self.regenerated + 1
        moved = bool(model_id and self.model_id and model_id != self.model_id)
        if moved:
            self.rebuilt_from_model_id = self.model_id
        self.model_id = model_id or self.model_id
        return moved

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})  # NOTE: records written before a field keep its default


class RegistryStore(Protocol):
    """The part of a BlobStore (fleet.cas) the registry uses: its key-value namespace."""

    def kv_get(self, namespace: str, key: str) -> bytes | None: ...

    def kv_put(self, namespace: str, key: str, value: bytes) -> None: ...

    def kv_delete(self, namespace: str, key: str) -> None: ...

    def kv_swap(self, namespace: str, key: str, old: bytes | None, new: bytes | None) -> bool: ...

    def kv_scan(self, namespace: str) -> dict[str, bytes]: ...


class Stored(NamedTuple):
    """A record and the exact bytes the store holds for it (what a conditional write compares)."""

    rec: SessionRecord
    raw: bytes


class SessionRegistry:
    """The fleet's session records in `store`, keyed `{tenant}/{session}`."""

    def __init__(self, store: RegistryStore) -> None:
        self.store = store

    def get(self, tenant: str, session_id: str) -> SessionRecord | None:
        """The record, `creating` ones included; None when there is none."""
        raw = self.store.kv_get(NAMESPACE, _key(tenant, session_id))
        return None if raw is None else SessionRecord.from_dict(json.loads(raw))

    def read(self, tenant: str, session_id: str) -> Stored | None:
        """The record with its stored bytes (for `replace` and `remove`); None when there is none."""
        raw = self.store.kv_get(NAMESPACE, _key(tenant, session_id))
        return None if raw is None else Stored(SessionRecord.from_dict(json.loads(raw)), bytes(raw))

    def save(self, rec: SessionRecord) -> None:
        """Write `rec` whatever the store holds (tests and tools; the fleet writes conditionally)."""
        self.store.kv_put(NAMESPACE, _key(rec.tenant, rec.session), _encode(rec))

    def insert(self, rec: SessionRecord) -> bytes | None:
        """Write a new record while no record holds its name; its bytes, or None when one does."""
        raw = _encode(rec)
        return raw if self.store.kv_swap(NAMESPACE, _key(rec.tenant, rec.session), None, raw) else None

    def replace(self, rec: SessionRecord, old: bytes) -> bytes | None:
        """Write `rec` over its record while the store still holds `old` (the bytes read or written last); the
        new bytes, or None when the record changed or went meanwhile (nothing written)."""
        raw = _encode(rec)
        return raw if self.store.kv_swap(NAMESPACE, _key(rec.tenant, rec.session), old, raw) else None

    def remove(self, tenant: str, session_id: str, old: bytes) -> bool:
        """Delete the record while the store still holds `old`; whether it did."""
        return self.store.kv_swap(NAMESPACE, _key(tenant, session_id), old, None)

    def delete(self, tenant: str, session_id: str) -> None:
        self.store.kv_delete(NAMESPACE, _key(tenant, session_id))

    def records(self, tenant: str | None = None) -> list[SessionRecord]:
        """Every record (of `tenant`, when given), `creating` ones included, in key order."""
        recs = [SessionRecord.from_dict(json.loads(raw)) for _, raw in sorted(self.store.kv_scan(NAMESPACE).items())]
        return [r for r in recs if tenant is None or r.tenant == tenant]


def _encode(rec: SessionRecord) -> bytes:
    return json.dumps(rec.to_dict()).encode()


def _key(tenant: str, session_id: str) -> str:
    return f"{tenant}/{session_id}"
