"""KernelFleet: the small Python API over the Ray fleet of session kernels (wrapped in gRPC later).

    fleet = KernelFleet("sqlite:///kvfleet.db", {"kind": "synthetic"})
    fleet.create_session("acme", "s1", "You are a helpful agent.")
    r = fleet.append("acme", "s1", "hello")          # r.logits, r.num_tokens
    fleet.list_sessions(fleet=True)                   # one row per session, across nodes

Calls go straight to the session's actor. A dead actor (killed, its worker process gone) is
marked lost (witness kv="forgotten", epoch + 1) and regenerated from its op log by its node's
supervisor, then the call is retried once with the same op id (so an op that was logged just
before the crash is not applied twice). Every wait has a timeout: a fault never hangs a caller.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from fleet.errors import AlreadyExists, InvalidArgument, KvfleetError, NotFound, Unavailable
from fleet.kernel.tokenizer import encode_message
from fleet.lifecycle import Witness
from workers.placement import (
    NAMESPACE,
    NodeOffer,
    choose_node,
    drop_blob_refs,
    fleet_scope,
    on_node,
    session_actor_name,
    supervisor_name,
)
from workers.spec import KernelSpec, make_kernel, make_tokenizer
from workers.supervisor import NodeSupervisor

REGISTRY = "kvfleet.sessions"


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What a mutating call returned: `result` is the verb's (a Piece, an EvictReport, an
    Admission); `logits` the session's next-token logits; `replayed` True when the op was already
    in the log (a retry after a crash) and was answered, not applied again."""

    result: Any
    logits: np.ndarray | None
    num_tokens: int
    op_index: int | None
    replayed: bool


def _result(r: dict[str, Any]) -> AppendResult:
    return AppendResult(r["result"], r["logits"], r["num_tokens"], r["op_index"], r["replayed"])


class KernelFleet:
    """Sessions on Ray actors, one supervisor per node, state durable in the store."""

    def __init__(self, store_url: str, kernel_spec: dict[str, Any] | KernelSpec | None = None, *,
                 node_budget_bytes: int = 64 << 20, policy: str = "lru", call_timeout_s: float = 60.0,
                 detached: bool = False) -> None:
        """Args:
            store_url: the store every actor opens (op logs, session registry).
            kernel_spec: which kernel every session runs (KernelSpec or its dict).
            node_budget_bytes: per-node memory budget of the radix prefix cache.
            policy: its eviction policy ("lru", "lfu", "mru", "next-use").
            call_timeout_s: the longest any call waits; past it, Unavailable.
            detached: supervisors (and the sessions they own) outlive this process, so a restarted
                controller finds them warm; otherwise they go with it and are regenerated from the
                op logs on first use.
        """
        from fleet.cas import open_store

        if not ray.is_initialized():
            ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
        self.store_url, self.call_timeout_s = store_url, call_timeout_s
        self.spec = KernelSpec.from_dict(kernel_spec or {})
        self.kernel = make_kernel(self.spec)
        self.tokenizer = make_tokenizer(self.kernel)
        self.store = open_store(store_url)
        self._budget, self._policy, self._detached = node_budget_bytes, policy, detached
        self.supervisors = self._ensure_supervisors()
        self.num_regenerations = 0
        self._handles: dict[tuple[str, str], Any] = {}

    # -- supervisors and placement ------------------------------------------------------------

    def _ensure_supervisors(self) -> dict[str, Any]:
        out = {}
        for node in ray.nodes():  # type: ignore[no-untyped-call]
            if not node.get("Alive"):
                continue
            nid = node["NodeID"]
            out[nid] = ray.remote(NodeSupervisor).options(
                name=supervisor_name(nid, fleet_scope(self.store_url)), namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
                max_restarts=3, scheduling_strategy=on_node(nid), lifetime="detached" if self._detached else None,
            ).remote(nid, self.store_url, self.spec.to_dict(), self._budget, self._policy)
        return out

    def _place(self, tenant: str, tokens: list[int]) -> str:
        nids = list(self.supervisors)
        answers = [self._sup(n, "match_len", tenant, tokens) for n in nids]
        return choose_node([NodeOffer(n, m, s) for n, (m, s) in zip(nids, answers, strict=True)])

    # -- registry (in the store: survives the driver) -----------------------------------------

    def _record(self, tenant: str, session_id: str) -> dict[str, Any]:
        raw = self.store.kv_get(REGISTRY, f"{tenant}/{session_id}")
        if raw is None:
            raise NotFound(f"session {session_id!r} not found (unknown or closed)")
        return dict(json.loads(raw))

    def _save(self, rec: dict[str, Any]) -> None:
        self.store.kv_put(REGISTRY, f"{rec['tenant']}/{rec['session']}", json.dumps(rec).encode())

    # -- calls --------------------------------------------------------------------------------

    def _get(self, refs: Any) -> Any:
        try:
            return ray.get(refs, timeout=self.call_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise Unavailable(f"a worker did not answer within {self.call_timeout_s:.0f}s") from e
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, KvfleetError):
                raise e.cause from None
            raise

    def _sup(self, node: str, method: str, *args: Any) -> Any:
        """Call a node's supervisor; while Ray restarts it (ActorUnavailableError), retry until
        the call timeout (supervisor calls are safe to repeat)."""
        deadline = time.monotonic() + self.call_timeout_s
        for attempt in itertools.count():
            try:
                return self._get(getattr(self.supervisors[node], method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"the supervisor of node {node} stayed unavailable") from None
                time.sleep(min(0.05 * (attempt + 1), 1.0))
        raise AssertionError("unreachable")  # pragma: no cover

    def _call(self, tenant: str, session_id: str, method: str, *args: Any) -> Any:
        """Call the session's actor; a dead one is regenerated and the call retried once."""
        key = (tenant, session_id)
        for attempt in range(2):
            actor = self._handles.get(key) or self._lookup(tenant, session_id)
            if actor is not None:
                try:
                    return self._get(getattr(actor, method).remote(*args))
                except ray.exceptions.RayActorError as e:
                    self._handles.pop(key, None)
                    if attempt:
                        raise Unavailable(f"session {session_id}: actor lost again after regeneration") from e
            elif attempt:
                raise Unavailable(f"session {session_id}: no actor after regeneration")
            self._regenerate(self._record(tenant, session_id))   # NotFound when closed meanwhile
        raise Unavailable(f"session {session_id}: unreachable")  # pragma: no cover - loop returns or raises

    def _lookup(self, tenant: str, session_id: str) -> Any:
        """The live actor of a registered session (None if it is gone); NotFound if unregistered."""
        self._record(tenant, session_id)
        try:
            actor = ray.get_actor(session_actor_name(tenant, session_id, fleet_scope(self.store_url)), namespace=NAMESPACE)
        except ValueError:  # no live actor by that name: it died and its name was released
            return None
        self._handles[(tenant, session_id)] = actor
        return actor

    def _regenerate(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Mark the session lost (kv forgotten), rebuild it from its op log, mark it active."""
        rec["epoch"] = int(rec.get("epoch", 0)) + 1
        lost = Witness("actor_lost", "error", "forgotten", True, False, rec["epoch"])
        rec.update(state="lost", witness=lost.to_dict())
        self._save(rec)
        node = rec["node"] if rec["node"] in self.supervisors else self._place(rec["tenant"], [])
        self._sup(node, "regenerate", rec["tenant"], rec["session"])
        rec.update(state="active", node=node, regenerated=int(rec.get("regenerated", 0)) + 1)
        self._save(rec)
        self.num_regenerations += 1
        return rec

    def _tokens(self, x: str | bytes | list[int]) -> list[int]:
        ids = self.tokenizer.encode(x) if isinstance(x, str | bytes) else list(x)
        vocab = self.kernel.config.vocab_size
        if not all(isinstance(t, int | np.integer) and 0 <= t < vocab for t in ids):
            raise InvalidArgument(f"token ids must be ints in [0, {vocab})")
        return [int(t) for t in ids]

    # -- session verbs ------------------------------------------------------------------------

    def create_session(self, tenant: str, session_id: str, system_prompt: str) -> dict[str, Any]:
        """Place and start a session; it adopts the node's warm prefix blocks if it has them."""
        from fleet.cas.base import check_name, check_tenant

        check_tenant(tenant)
        check_name("session_id", session_id)
        if not isinstance(system_prompt, str) or not system_prompt:
            raise InvalidArgument("the system prompt must be a non-empty str")
        tokens = self._tokens(encode_message(self.tokenizer, "system", system_prompt))  # the piece's own tokens
        if self.store.kv_get(REGISTRY, f"{tenant}/{session_id}") is not None:
            raise AlreadyExists(f"session {session_id!r} already exists")
        node = self._place(tenant, tokens)
        rec = {"tenant": tenant, "session": session_id, "node": node, "state": "creating", "epoch": 0,
               "created": time.time()}
        self._save(rec)
        try:
            out = self._sup(node, "create_session", tenant, session_id, system_prompt, tokens, uuid.uuid4().hex)
        except BaseException:  # not acknowledged: leave nothing behind
            self._discard(tenant, session_id, node)
            raise
        rec.update(state="active", adopted_tokens=out["adopted_tokens"])
        self._save(rec)
        return rec

    def _op(self, tenant: str, session_id: str, verb: str, *args: Any) -> AppendResult:
        return _result(self._call(tenant, session_id, verb, *args, uuid.uuid4().hex))

    def append(self, tenant: str, session_id: str, content: str | list[int], role: str = "user") -> AppendResult:
        """Append a message (text, with its role) or model output (token ids); result: the Piece."""
        if isinstance(content, list):
            content = self._tokens(content)
        elif not isinstance(content, str):
            raise InvalidArgument(f"append takes text or token ids, got {type(content).__name__}")
        return self._op(tenant, session_id, "append", content, role)

    def generate(self, tenant: str, session_id: str, n: int) -> list[int]:
        """Greedy-decode `n` tokens and append them as an output piece; returns them."""
        return list(self._op(tenant, session_id, "generate", n).result.tokens)

    def evict(self, tenant: str, session_id: str, piece_id: int, mode: str = "exact") -> Any:
        """Evict one piece from the session's KV cache; returns the kernel's EvictReport."""
        return self._op(tenant, session_id, "evict", piece_id, mode).result

    def add_tool_result(self, tenant: str, session_id: str, ref: str) -> AppendResult:
        """Append a tool result stored in the CAS (by ref); quarantined refs are refused."""
        return self._op(tenant, session_id, "add_tool_result", ref)

    def admit_tool_result(self, tenant: str, session_id: str, ref: str) -> Any:
        """Detector verdict on a stored tool result; QUARANTINED evicts it with a witness (Admission)."""
        return self._op(tenant, session_id, "admit_tool_result", ref).result

    def working_set(self, tenant: str, session_id: str, budget_tokens: int) -> Any:
        """HIT / FAULT / RECOMPUTE / REFUSE / ABSTAIN per piece (fleet.working_set.WorkingSet)."""
        return self._call(tenant, session_id, "working_set", budget_tokens)

    def fork(self, tenant: str, session_id: str, child_id: str, share: bool = True) -> dict[str, Any]:
        """A branch in its own actor, isolated from the parent (copy-on-write).

        On the parent's node (the usual case) the child adopts the parent's block-aligned prefix
        from the node's object store and computes only the tokens past it, so N branches cost
        about the prefix once plus N suffixes. If the parent's node is gone the child is placed
        elsewhere and replays the parent's log instead: blocks are shared zero-copy only within a
        node's object store, and a remote fetch would copy them anyway. `share=False` replays too
        (a full private copy). Either way the child's log is the parent's + a fork marker, so a
        regeneration replays it bit-identically.
        """
        from fleet.cas.base import check_name

        check_name("session_id", child_id)
        self._record(tenant, session_id)
        if self.store.kv_get(REGISTRY, f"{tenant}/{child_id}") is not None:
            raise AlreadyExists(f"session {child_id!r} already exists")
        point = self._call(tenant, session_id, "fork_point")       # ops and tokens read together
        parent = self._record(tenant, session_id)                  # its node, after any regeneration
        ops = [*point["ops"], {"op": "fork", "parent": session_id, "at": len(point["ops"])}]
        node = parent["node"] if parent["node"] in self.supervisors else self._place(tenant, [])
        same_node = share and node == parent["node"]             # another node: replay (no sharing)
        rec = {"tenant": tenant, "session": child_id, "node": node, "state": "creating", "epoch": 0,
               "created": time.time(), "parent": session_id}
        self._save(rec)
        try:
            args = (session_id, point["tokens"]) if same_node else ()
            out = self._sup(node, "fork", tenant, ops, child_id, *args)
        except BaseException:
            self._discard(tenant, child_id, node)
            raise
        rec.update(state="active", adopted_tokens=out["adopted_tokens"])
        self._save(rec)
        return rec

    def evict_prefix(self, tenant: str, prompt: str | list[int], start: int = 0) -> int:
        """Policy eviction by name on every node: drop the cached blocks of this prompt prefix from
        position `start` (a block multiple) on, and everything below them, regardless of recency. Sessions that
        already adopted the blocks keep their own references. Returns blocks dropped fleet-wide."""
        tokens = self._tokens(prompt)
        total = 0
        for node in self.supervisors:
            try:
                total += len(self._sup(node, "evict_node", tenant, tokens, start)["block_ids"])
            except NotFound:
                continue
        return total

    def close(self, tenant: str, session_id: str) -> None:
        """Stop the session's actor and delete its op log; later calls raise NotFound."""
        rec = self._record(tenant, session_id)
        self._discard(tenant, session_id, rec["node"])

    def _discard(self, tenant: str, session_id: str, node: str) -> None:
        self._handles.pop((tenant, session_id), None)
        self.store.kv_delete(REGISTRY, f"{tenant}/{session_id}")
        if node in self.supervisors:
            self._sup(node, "close", tenant, session_id)
        drop_blob_refs(self.store, self.store.oplog_read(tenant, session_id))
        self.store.oplog_delete(tenant, session_id)

    # -- reads --------------------------------------------------------------------------------

    def digest(self, tenant: str, session_id: str) -> str:
        return str(self._call(tenant, session_id, "digest"))

    def last_logits(self, tenant: str, session_id: str) -> np.ndarray | None:
        return self._call(tenant, session_id, "last_logits")  # type: ignore[no-any-return]

    def pieces(self, tenant: str, session_id: str) -> list[Any]:
        return list(self._call(tenant, session_id, "pieces"))

    def tokens(self, tenant: str, session_id: str) -> list[int]:
        return list(self._call(tenant, session_id, "tokens"))

    def info(self, tenant: str, session_id: str) -> dict[str, Any]:
        return dict(self._call(tenant, session_id, "info"))

    def node_stats(self) -> list[dict[str, Any]]:
        return [self._sup(n, "stats") for n in self.supervisors]

    def list_sessions(self, fleet: bool = True, tenant: str | None = None) -> list[dict[str, Any]]:
        """Rows: session, tenant, node, actor, tokens, bytes alone/shared, hit rate, quarantined
        spans, state, epoch, last active. `fleet=False` lists only this process's node."""
        here = ray.get_runtime_context().get_node_id()
        sups = [n for n in self.supervisors if fleet or n == here]
        live = {(r["tenant"], r["session"]): r for n in sups for r in self._sup(n, "rows", tenant)}
        out = []
        for _key, raw in sorted(self.store.kv_scan(REGISTRY).items()):
            rec = json.loads(raw)
            if (tenant is not None and rec["tenant"] != tenant) or (not fleet and rec["node"] not in sups):
                continue  # fleet=True also lists sessions whose node is gone (state: lost)
            row = {**rec, **live.get((rec["tenant"], rec["session"]), {"state": "lost", "tokens": 0})}
            row["epoch"] = max(int(rec.get("epoch", 0)), int(row.get("epoch", 0)))
            row["hit_rate"] = row.get("adopted_tokens", 0) / row["tokens"] if row.get("tokens") else 0.0
            out.append(row)
        return out

    def shutdown(self) -> None:
        """Kill the supervisors (and with them every session actor they own); the logs stay."""
        for s in self.supervisors.values():
            ray.kill(s, no_restart=True)
        self.supervisors = {}
        self.store.close()
