"""KernelFleet: the small Python API over the Ray fleet of session kernels (wrapped in gRPC later).

    fleet = KernelFleet("sqlite:///kvfleet.db", {"kind": "synthetic"})
    fleet.create_session("acme", "s1", "You are a helpful agent.")
    r = fleet.append("acme", "s1", "hello")          # r.logits, r.num_tokens
    fleet.list_sessions(fleet=True)                   # one row per session, across nodes

A session lives in its node's kernel host (workers/host.py: one Ray actor, one process per node, many
sessions). Calls go to that host, which runs them on the session's SessionKernel. A session the host
no longer holds (the host died and Ray restarted it empty, or its node is gone) is marked lost
(witness kv="forgotten", epoch + 1) and regenerated from its op log, then the call is retried once
with the same op id (so an op that was logged just before the crash is not applied twice). A session whose
call failed after logging its op answers SessionGone too (workers/session_kernel.py SessionTorn): it is
rebuilt from its log the same way. Every wait has a timeout: a fault never hangs a caller.

Calls that change what stands behind a name (create, fork, close, release, rebuild) may overlap: threads of
one fleet take the name's lock (workers/name_locks.py), so a create that loses to another gets AlreadyExists
and a close waits for a rebuild. Writers in other processes (two controllers during a leader change) are
kept apart by the registry's compare-and-set and the host's check-and-insert: a try that fails removes only
what it made (the kernel, op log and record of its own op id), never the session that won the name. A try whose
host call timed out may still be run by its host after that cleanup: the kernel it leaves, which no record names,
is replaced by the next create or fork of the name on that host, which the record names (KernelHost._insert).

Nodes come and go: the hosts follow Ray's node table (re-read at most every `node_refresh_s`, and
at once after a failure). A node that joins and has the resources sessions need gets a host and
takes new sessions; a node that dies is dropped, and its sessions are regenerated on a survivor on
their next call (or by `reconcile()`). Placement skips nodes whose KV or session budget is spent;
when none has room, ResourceExhausted.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from fleet.core.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.oplog import ForkOp, kv_follows_tokens, made_by, parse_log
from fleet.core.session_types import OpResult, check_session_id, check_token_ids
from workers.name_locks import NameLocks
from workers.nodes import FleetNodes, NodeGone
from workers.placement import (
    NODE_KV_BYTES,
    NODE_MAX_SESSIONS,
    RAY_NAMESPACE,
    drop_blob_refs,
    node_of,
    node_resources,
)
from workers.registry import CREATING, IDLE, LOST, SessionRecord, SessionRegistry, Stored
from workers.session_kernel import SessionGone, SessionKernel
from workers.spec import KernelSpec, make_kernel, make_tokenizer

__all__ = ["KernelFleet", "NodeGone", "OpResult"]

log = logging.getLogger(__name__)

RECONCILE_THREADS = 8  # sessions `reconcile` rebuilds at once (a host rebuilds them on its lanes)
PLACE_TRIES = 3  # placements of one create, fork or rebuild (its host was full after all, its node died) before giving up
REBUILD_TRIES = 3  # reads of a record another controller changed during a rebuild before giving up


class _Changed(Exception):
    """The record changed under a rebuild (another controller wrote it): read it again."""


def _rebuild_owner(rec: SessionRecord) -> str:
    """The token a rebuild of this session at its epoch opens its kernel with (one per session and loss)."""
    return f"{rec.create_op_id}@{rec.epoch}"


class KernelFleet:
    """Sessions in kernel hosts (one Ray actor per node), state durable in the store."""

    def __init__(self, store_url: str, kernel_spec: dict[str, Any] | KernelSpec | None = None, *,
                 node_budget_bytes: int = 64 << 20, policy: str = "lru", call_timeout_s: float = 60.0,
                 detached: bool = False, node_kv_bytes: int = NODE_KV_BYTES, resources: dict[str, float] | None = None,
                 node_refresh_s: float = 1.0, node_max_sessions: int = NODE_MAX_SESSIONS,
                 host_threads: int = 0) -> None:
        """Args:
            store_url: the store every host opens (op logs, session registry).
            kernel_spec: which kernel every session runs (KernelSpec or its dict).
            node_budget_bytes: per-node memory budget of the radix prefix cache.
            policy: its eviction policy ("lru", "lfu", "mru", "next-use").
            call_timeout_s: the longest any call waits; past it, Unavailable.
            detached: the kernel hosts, sessions and all, outlive this process (detached, named in
                the kvfleet namespace), so a restarted controller reattaches to them warm; otherwise
                they go with it and are regenerated from the op logs on first use. Either way, the hosts
                of a previous host API version are stopped at start (their sessions are rebuilt from their
                logs on this version's hosts).
            node_kv_bytes: each node's KV budget (cached blocks + sessions' private blocks); a
                node whose budget is spent takes no new session.
            resources: custom Ray resources every kernel host asks for (e.g. {"accel": 0.01});
                nodes without them (and without CPU, like a 0-CPU head) get no session.
            node_refresh_s: how often, at most, Ray's node table is re-read to follow nodes.
            node_max_sessions: the most sessions one node's host holds.
            host_threads: each host's kernel threads (0: the node's CPUs, at least 2).
        """
        from fleet.cas import open_store

        if not ray.is_initialized():
            ray.init(namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False)
        self.store_url, self.call_timeout_s = store_url, call_timeout_s
        self.spec = KernelSpec.from_dict(kernel_spec or {})
        self.kernel = make_kernel(self.spec.on_cpu())  # tokenizer and geometry; a CUDA spec runs on its nodes only
        self.tokenizer = make_tokenizer(self.kernel)
        self.store = open_store(store_url)
        self.registry = SessionRegistry(self.store)
        self._detached = detached
        if not isinstance(node_kv_bytes, int) or node_kv_bytes <= 0:
            raise InvalidArgument(f"node_kv_bytes must be a positive int (bytes of KV per node), got {node_kv_bytes!r}")
        if not isinstance(node_max_sessions, int) or node_max_sessions <= 0:
            raise InvalidArgument(f"node_max_sessions must be a positive int, got {node_max_sessions!r}")
        self.bytes_per_token = self.kernel.block_bytes // self.kernel.block_size
        self.nodes = FleetNodes(self.spec, store_url, budget=node_budget_bytes, policy=policy, kv_bytes=node_kv_bytes,
                                resources=dict(resources or {}), detached=detached, refresh_s=node_refresh_s,
                                call_timeout_s=call_timeout_s, bytes_per_token=self.bytes_per_token,
                                max_sessions=node_max_sessions, host_threads=host_threads)
        self.num_regenerations = 0
        self._where: dict[tuple[str, str], str] = {}  # (tenant, session) -> the node whose host holds it
        self._guard = threading.Lock()
        self._names = NameLocks()  # create, fork, close, release, rebuild: one at a time per session
        self.nodes.stop_previous_hosts()  # NOTE: before its own start: a GPU node's old host holds the GPU they ask for
        self.refresh_nodes(force=True)
        if not self.hosts and self.nodes.num_without_gpu:
            raise Unavailable(f"no Ray node can run the kernel spec: {self.nodes.num_without_gpu} node(s) have no GPU "
                              "for the CUDA kernel of their group (a node without a GPU never runs one); add GPU "
                              "nodes, or give those groups a CPU kernel (--kernel-group GROUP=numpy:cpu)")
        if not self.hosts:
            raise Unavailable(f"no Ray node has the resources a session needs ({node_resources(resources or {})})")

    # -- kernel hosts and placement (workers/nodes.py) ---------------------------------------

    @property
    def hosts(self) -> dict[str, Any]:
        """The kernel hosts (Ray actor handles), by Ray node id."""
        return self.nodes.hosts

    def refresh_nodes(self, force: bool = False) -> list[str]:
        """Follow Ray's node table (FleetNodes.refresh); returns the node ids with a host."""
        return self.nodes.refresh(force)

    # -- registry (in the store: survives the driver) -----------------------------------------

    def _record(self, tenant: str, session_id: str) -> SessionRecord:
        """The session's registry record. A record still `creating` belongs to a create or fork
        that was never acknowledged (in flight, or its controller crashed): the session is absent."""
        return self._stored(tenant, session_id).rec

    def _stored(self, tenant: str, session_id: str) -> Stored:
        """`_record`, with the bytes a conditional write of it compares."""
        stored = self.registry.read(tenant, session_id)
        if stored is None or stored.rec.state == CREATING:
            raise NotFound(f"session {session_id!r} not found (unknown or closed)")
        return stored

    def check_session(self, tenant: str, session_id: str) -> None:
        """NotFound unless `session_id` is a registered session of `tenant` (a check before costly work)."""
        self._record(tenant, session_id)

    def _claim(self, tenant: str, session_id: str) -> None:
        """Make `session_id` free for a create or fork (its caller holds the name's lock): AlreadyExists if a
        session holds it; otherwise clear what a create, fork or close that never completed left behind (a
        record still `creating` with its kernel and log, an op log without a record), so a crash never strands
        a name. A record is removed only while it holds what was read here (another controller may write it)."""
        stored = self.registry.read(tenant, session_id)
        if stored is None:
            if self.store.oplog_read(tenant, session_id) and self.registry.read(tenant, session_id) is None:
                self._drop_log(tenant, session_id, None)
            return
        if stored.rec.state != CREATING or not self.registry.remove(tenant, session_id, stored.raw):
            raise AlreadyExists(f"session {session_id!r} already exists")
        self._clear(stored.rec)

    def _clear(self, rec: SessionRecord) -> None:
        """Drop the kernel and op log of a create or fork that was not acknowledged: those of its op id (any,
        for a record written before records named it)."""
        owner = rec.create_op_id or None
        self._close_kernel(rec.node, rec.tenant, rec.session, owner)
        self._drop_log(rec.tenant, rec.session, owner)

    def _abandon(self, rec: SessionRecord, raw: bytes) -> None:
        """A create or fork that failed leaves nothing behind, and removes nothing it did not make: its
        kernel and log (by its op id), then its record unless another writer changed it meanwhile."""
        self._clear(rec)
        self.registry.remove(rec.tenant, rec.session, raw)

    def _close_kernel(self, node: str, tenant: str, session_id: str, owner: str | None = None,
                      create_op_id: str | None = None) -> None:
        """Close the session's kernel on `node`'s host (with `owner`: only the one that try opened; with
        `create_op_id`: only a kernel of the session that create or fork made, a rebuild's included)."""
        if node in self.hosts:
            try:
                self.nodes.call(node, "close", tenant, session_id, owner, create_op_id)
            except NodeGone:  # its kernel went with the node
                pass

    def _drop_log(self, tenant: str, session_id: str, owner: str | None) -> None:
        """Delete the session's op log and give back its blob references (with `owner`: only the log that
        create or fork wrote)."""
        log = parse_log(self.store.oplog_read(tenant, session_id))
        if not log or (owner is not None and not made_by(log, owner)):
            return
        drop_blob_refs(self.store, log)
        self.store.oplog_delete(tenant, session_id)

    # -- calls --------------------------------------------------------------------------------

    def _call(self, tenant: str, session_id: str, method: Callable[..., Any], *args: Any) -> Any:
        """`method` (a SessionKernel method, named by reference so readers and tools can follow it) called
        with `args` on the session's host, and its answer; a session its host lost is regenerated and the
        call retried once."""
        key = (tenant, session_id)
        for attempt in range(2):
            node = self._where.get(key)
            if node is None:
                rec = self._record(tenant, session_id)             # NotFound when unknown or closed
                if not rec.live:                                    # released, or a rebuild that failed: rebuild
                    rec, _ = self._rebuild(tenant, session_id)
                node = self._where[key] = rec.node
            try:
                return self.nodes.call(node, "call", tenant, session_id, method.__name__, *args)
            except (SessionGone, NodeGone) as e:
                self._where.pop(key, None)
                if attempt:
                    with self._names.hold(key):           # a close in flight finishes first
                        self._record(tenant, session_id)  # NotFound when it was closed meanwhile
                    raise Unavailable(f"session {session_id}: lost again after regeneration") from e
            self._rebuild(tenant, session_id)
        raise Unavailable(f"session {session_id}: unreachable")  # pragma: no cover - loop returns or raises

    def _rebuild(self, tenant: str, session_id: str) -> tuple[SessionRecord, bool]:
        """Rebuild a session its host lost, once: callers (and `reconcile`) that saw the same loss at
        the same time wait for one rebuild instead of each replaying the log and stepping the epoch
        (the name's lock, which a close waits for too). Returns its record, and whether this call rebuilt it."""
        with self._names.hold((tenant, session_id)):
            for _ in range(REBUILD_TRIES):
                stored = self._stored(tenant, session_id)      # NotFound when closed meanwhile
                if stored.rec.live and self._holds(stored.rec):
                    return stored.rec, False                    # another caller rebuilt it meanwhile
                try:
                    return self._regenerate(stored), True
                except _Changed:                                # another controller wrote it: read it again
                    continue
        raise Unavailable(f"session {session_id}: its record kept changing while it was rebuilt; try again")

    def _holds(self, rec: SessionRecord) -> bool:
        """Whether the host of the record's node holds the session now, whole: its info answers. A session
        whose call failed after logging its op (SessionTorn) is held but not served (SessionGone): rebuilt."""
        try:
            self.nodes.call(rec.node, "call", rec.tenant, rec.session, SessionKernel.info.__name__)
        except (SessionGone, Unavailable):  # NodeGone included
            return False
        return True

    def _regenerate(self, stored: Stored) -> SessionRecord:
        """Mark the session lost (kv forgotten), rebuild it from its op log, mark it regenerated.

        The record names the node that rebuilds it before that host is asked, so when the call
        times out (a replay longer than `call_timeout_s`) the next rebuild of the same loss asks the
        same host, which joins the replay it still runs, or answers at once once it is done
        (KernelHost.regenerate), instead of starting the whole replay over: a slow rebuild settles.
        Each write is conditional on the record read or written last: a record a close removed meanwhile
        is never written back (NotFound), one another controller changed is read again (_Changed)."""
        rec, raw = stored
        rec.lose()
        raw = self._replace(rec, raw)
        node = rec.node if self.nodes.answers(rec.node) else self.nodes.place(rec.tenant, [], model_id=rec.model_id)
        raw, node, model_id = self._regenerate_placed(rec, raw, node)
        if rec.rebuilt(node, model_id):
            log.warning("session %s/%s was rebuilt on node %s by a kernel of model_id %s, not its own %s (no survivor "
                        "has it): its KV and logits are close to, not bit-identical with, what was acknowledged",
                        rec.tenant, rec.session, node, model_id, rec.rebuilt_from_model_id)
        if self.registry.replace(rec, raw) is None:
            self._forsake(rec)
        with self._guard:
            self.num_regenerations += 1
        return rec

    def _regenerate_placed(self, rec: SessionRecord, raw: bytes, node: str) -> tuple[bytes, str, str]:
        """`_regenerate_on` `node`, placed again when its host refuses the rebuild as full (its own host filled up
        since it was released, or another create took the last slot since the placement read the offers) or its
        node died just now: the refused node skipped, a kernel of the session's model_id preferred, up to
        PLACE_TRIES nodes. The record's bytes, the node that rebuilt it and its kernel's model_id. NOTE: a host
        did not refuse a rebuild when full: one on the session's own host overfilled it (3 of 2 sessions)."""
        for attempt in range(PLACE_TRIES):
            try:
                raw, model_id = self._regenerate_on(rec, raw, node)
                return raw, node, model_id
            except (NodeGone, ResourceExhausted):
                if attempt == PLACE_TRIES - 1:
                    raise
                node = self.nodes.place(rec.tenant, [], exclude=node, model_id=rec.model_id)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _regenerate_on(self, rec: SessionRecord, raw: bytes, node: str) -> tuple[bytes, str]:
        """Ask `node`'s host to rebuild the lost session, the record naming that node first; the record's bytes,
        and the model_id of the kernel that rebuilt it ("" from a host that does not say)."""
        if rec.node != node:
            rec.node = node
            raw = self._replace(rec, raw)  # still lost: the node a later rebuild of this loss asks first
        out = self.nodes.call(node, "regenerate", rec.tenant, rec.session, rec.epoch, _rebuild_owner(rec),
                              rec.create_op_id)
        return raw, str(out.get("model_id", ""))

    def _replace(self, rec: SessionRecord, raw: bytes) -> bytes:
        """Write `rec` over the record read or written last (`raw`); _Changed when another writer changed it,
        NotFound when it was removed (closed)."""
        new = self.registry.replace(rec, raw)
        if new is None:
            if self.registry.read(rec.tenant, rec.session) is None:
                raise NotFound(f"session {rec.session!r} not found (closed while it was rebuilt)")
            raise _Changed
        return new

    def _forsake(self, rec: SessionRecord) -> None:
        """After a rebuild whose record changed or went meanwhile: close the kernel it made unless the record
        now names that very kernel (another controller's rebuild of the same loss, joined on its host); then
        NotFound (closed) or _Changed (read it again)."""
        now = self.registry.read(rec.tenant, rec.session)
        if now is None or (now.rec.node, now.rec.epoch) != (rec.node, rec.epoch):
            self._close_kernel(rec.node, rec.tenant, rec.session, _rebuild_owner(rec))
        if now is None:
            raise NotFound(f"session {rec.session!r} not found (closed while it was rebuilt)")
        raise _Changed

    def _tokens(self, x: str | bytes | list[int]) -> list[int]:
        """Text encoded, or token ids checked (the one rule: check_token_ids); the Python API's edge."""
        if isinstance(x, str | bytes):
            return self.tokenizer.encode(x)
        return check_token_ids(x, self.kernel.config.vocab_size) if len(x) else []

    # -- session verbs ------------------------------------------------------------------------

    def create_session(self, tenant: str, session_id: str, system_prompt: str,
                       tokens: list[int] | None = None) -> dict[str, Any]:
        """Place and start a session; it adopts the node's warm prefix blocks if it has them.

        Args:
            tokens: `system_prompt` already encoded (`encode_message(self.tokenizer, "system", ...)`),
                by a caller that counted them; encoded here when None. Never encoded again below.
        """
        from fleet.cas.base import check_tenant

        check_tenant(tenant)
        check_session_id("session_id", session_id)
        if not isinstance(system_prompt, str) or not system_prompt:
            raise InvalidArgument("the system prompt must be a non-empty str")
        if tokens is None:
            tokens = encode_message(self.tokenizer, "system", system_prompt)  # the piece's own tokens
        with self._names.hold((tenant, session_id)):
            self._claim(tenant, session_id)
            node = self.nodes.place(tenant, tokens)
            # one op id for every try: the log a try left when its host died after logging the system op is
            # recognised by the next, which drops it (SessionKernel._drop_earlier_try) instead of logging twice;
            # it also names what this create made (kernel, log, record), all its cleanup may remove
            rec = SessionRecord(tenant, session_id, node, create_op_id=uuid.uuid4().hex)
            raw = self._insert(rec)
            try:
                for attempt in range(PLACE_TRIES):
                    try:
                        out = self.nodes.call(rec.node, "create_session", tenant, session_id, tokens, rec.create_op_id)
                        break
                    except (NodeGone, ResourceExhausted):
                        if attempt == PLACE_TRIES - 1:
                            raise
                        raw = self._place_again(rec, raw, tokens)
            except BaseException:  # not acknowledged: leave nothing of it behind, and nothing else removed
                self._abandon(rec, raw)
                raise
            rec.acknowledged(out["adopted_tokens"], model_id=str(out.get("model_id", "")))
            self._acknowledge(rec, raw)
        return rec.to_dict()

    def _place_again(self, rec: SessionRecord, raw: bytes, tokens: list[int]) -> bytes:
        """A create's or fork's host refused it (full: another create took its last slot since the placement read
        the offers) or its node died: what the try left there goes, and the record names another node (the one
        refused skipped); the record's bytes. NOTE: a create that raced another for a host's last slot got
        ResourceExhausted although another host had room."""
        self._clear(rec)
        rec.node = self.nodes.place(rec.tenant, tokens, exclude=rec.node)
        return self.registry.replace(rec, raw) or raw   # unchanged unless another controller cleared it

    def _insert(self, rec: SessionRecord) -> bytes:
        """Write a create's or fork's `creating` record while no record holds the name; its bytes. AlreadyExists
        when one does (another controller's create or fork wrote it since the claim)."""
        raw = self.registry.insert(rec)
        if raw is None:
            raise AlreadyExists(f"session {rec.session!r} already exists")
        return raw

    def _acknowledge(self, rec: SessionRecord, raw: bytes) -> None:
        """Write the acknowledged record over its `creating` one. When another controller's create or fork
        cleared that meanwhile (it took it for a crashed one) and took the name, this one is not acknowledged:
        what it made is removed, and the caller gets AlreadyExists."""
        if self.registry.replace(rec, raw) is None:
            self._clear(rec)
            raise AlreadyExists(f"session {rec.session!r} was taken by another create or fork meanwhile")

    # Mutating verbs: each runs under `op_id` (the caller's idempotency key; a fresh one if empty), and an
    # op id already in the session's log is answered (replayed=True), not applied again. Each returns the
    # SessionKernel's OpResult: its `result` (a Piece, an EvictReport, a ToolAdmission), the session's token count
    # and last logits.

    def append(self, tenant: str, session_id: str, content: str | list[int], role: str = "user",
               op_id: str = "") -> OpResult:
        """Append a message (text, with its role; encoded here, the Python API's edge) or model output
        (token ids); result: the Piece."""
        if isinstance(content, list):
            return self.append_output(tenant, session_id, self._tokens(content), op_id)
        if not isinstance(content, str):
            raise InvalidArgument(f"append takes text or token ids, got {type(content).__name__}")
        return self.append_message(tenant, session_id, encode_message(self.tokenizer, role, content), role, op_id)

    def append_message(self, tenant: str, session_id: str, tokens: list[int], role: str,
                       op_id: str = "") -> OpResult:
        """Append a chat message already encoded (`encode_message(self.tokenizer, role, text)`) by a caller
        that counted its tokens: it is never encoded again."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.append_message, tokens, role, key)  # type: ignore[no-any-return]

    def append_output(self, tenant: str, session_id: str, tokens: list[int], op_id: str = "") -> OpResult:
        """Append model output: token ids the caller checked (`check_token_ids`)."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.append_output, tokens, key)  # type: ignore[no-any-return]

    def generate(self, tenant: str, session_id: str, n: int, op_id: str = "") -> OpResult:
        """Greedy-decode `n` tokens and append them as an output piece (`result.tokens`)."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.generate, n, key)  # type: ignore[no-any-return]

    def evict(self, tenant: str, session_id: str, piece_id: int, mode: str = "exact", op_id: str = "") -> OpResult:
        """Evict one piece from the session's KV cache; `result`: the kernel's EvictReport."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.evict, piece_id, mode, key)  # type: ignore[no-any-return]

    def add_tool_result(self, tenant: str, session_id: str, ref: str, op_id: str = "") -> OpResult:
        """Append a tool result stored in the CAS (by ref); quarantined refs are refused."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.add_tool_result, ref, key)  # type: ignore[no-any-return]

    def admit_tool_result(self, tenant: str, session_id: str, ref: str, verdict: Any = None,
                          op_id: str = "") -> OpResult:
        """A verdict on a stored tool result (`verdict`, or the session's default detector when None);
        QUARANTINED evicts it with a proof (`result`: a ToolAdmission)."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.admit_tool_result, ref, verdict, key)  # type: ignore[no-any-return]

    def working_set(self, tenant: str, session_id: str, budget_tokens: int) -> Any:
        """HIT / FAULT / RECOMPUTE / REFUSE / ABSTAIN per piece (fleet.core.working_set.WorkingSet)."""
        return self._call(tenant, session_id, SessionKernel.working_set, budget_tokens)

    def fork(self, tenant: str, session_id: str, child_id: str, share: bool = True,
             node: str | None = None) -> dict[str, Any]:
        """A branch, a session of its own, isolated from the parent (copy-on-write).

        On the parent's node (the usual case, while its KV budget has room) the child adopts the
        parent's block-aligned prefix from the node's object store zero-copy and computes only
        the tokens past it, so N branches cost about the prefix once plus N suffixes. On another
        node (the parent's is full, or `node` names another) the child adopts the same blocks,
        which Ray moves from the parent's node through the object store (`moved_bytes` in the
        record): a copy, but no recompute. `share=False` replays the log (a full private copy).
        Either way the child's log is the parent's + a fork marker, so a regeneration replays it
        bit-identically. A parent whose node is gone is regenerated first (by its fork point).
        """
        check_session_id("child_id", child_id)
        if node is not None and not self.nodes.alive(node):
            raise InvalidArgument(f"node {node!r} is not an alive node of this fleet: see node_stats()")
        self._record(tenant, session_id)
        taken = self.registry.get(tenant, child_id)
        if taken is not None and taken.state != CREATING:
            raise AlreadyExists(f"session {child_id!r} already exists")  # early; the claim below decides
        point = self._call(tenant, session_id, SessionKernel.fork_point)  # ops and tokens read together
        parent = self._record(tenant, session_id)                  # its node, after any regeneration
        op_id = uuid.uuid4().hex                                   # the fork's: its marker and record carry it
        ops = [*point["ops"], ForkOp(session_id, len(point["ops"]), op_id)]
        with self._names.hold((tenant, child_id)):                 # NOTE: not the parent's: no lock is held twice
            self._claim(tenant, child_id)
            named = node is not None                               # a node the caller named is not placed again
            node = node or self._fork_node(tenant, parent.node, point["tokens"])
            rec = SessionRecord(tenant, child_id, node, parent=session_id, create_op_id=op_id)
            raw = self._insert(rec)
            try:
                for attempt in range(PLACE_TRIES):
                    try:
                        args = self._fork_args(tenant, session_id, parent.node, rec.node, point, share)
                        out = self.nodes.call(rec.node, "fork", tenant, ops, child_id, *args)
                        break
                    except ResourceExhausted:   # its host was full after all: another node, where one has room
                        if named or attempt == PLACE_TRIES - 1:
                            raise
                        raw = self._place_again(rec, raw, point["tokens"])
                node = rec.node
            except BaseException:  # not acknowledged: leave nothing of it behind, and nothing else removed
                self._abandon(rec, raw)
                raise
            # NOTE: the blocks the child adopted, not the refs it was handed: a child that refused them (its log
            # re-rotated KV) fetched none, and its record said 184,320 bytes moved beside 0 tokens adopted
            moved = 0 if node == parent.node else out["adopted_tokens"] // self.kernel.block_size * self.kernel.block_bytes
            rec.acknowledged(out["adopted_tokens"], moved, str(out.get("model_id", "")))
            self._acknowledge(rec, raw)
        return rec.to_dict()

    def _fork_node(self, tenant: str, parent_node: str, tokens: list[int]) -> str:
        """The parent's node while its KV and session budgets have room (zero-copy sharing), else placement.
        NOTE: the session budget was not asked: with --node-max-sessions 2, six forks went to a full node (8)."""
        try:
            offer = self.nodes.call(parent_node, "offer", tenant, tokens)
        except Unavailable:
            return self.nodes.place(tenant, tokens, exclude=parent_node)
        if offer["free_bytes"] > 0 and offer["sessions"] < offer["max_sessions"]:
            return parent_node
        return self.nodes.place(tenant, tokens)  # the parent's node skipped as full (named when every node is)

    def _fork_args(self, tenant: str, parent_id: str, parent_node: str, node: str, point: dict[str, Any],
                   share: bool) -> tuple[Any, ...]:
        """The host's fork arguments past (tenant, ops, child), from the parent's fork `point` (its ops and
        tokens): same node: the parent's id (zero-copy); another node: the parent's block refs (fetched
        across); no sharing, a log whose KV does not follow its tokens (the child replays it op by op), a
        node of another kernel spec (node group), or a parent its host no longer knows: none (replay)."""
        tokens = point["tokens"]
        if not share:
            return ()
        if node == parent_node:
            return (parent_id, tokens)
        if not kv_follows_tokens(point["ops"]):
            return ()  # the child would refuse the blocks (a reposition eviction re-rotated them): export none
        if self.nodes.specs.get(node) != self.nodes.specs.get(parent_node):
            return ()  # another backend/device (node group): its KV is not portable, replay it there
        try:
            if self.nodes.call(parent_node, "model_id") != self.nodes.call(node, "model_id"):
                # NOTE: compared by backend and device alone, nodes of one spec on CPUs of other code paths (AVX-512
                # and AVX2) exchanged blocks whose bits differ from what the child's node computes (1.4e-6)
                return ()  # another CPU code path, or other weights: replay it there, exporting nothing
            shared = self.nodes.call(parent_node, "share_prefix", tenant, parent_id, tokens)
        except (NotFound, Unavailable):
            return ()
        return (None, tokens, shared["refs"], shared["model_id"])

    def evict_prefix(self, tenant: str, prompt: str | list[int], start: int = 0) -> int:
        """Policy eviction by name on every node: drop the cached blocks of this prompt prefix from
        position `start` (a block multiple) on, and everything below them, regardless of recency. Sessions that
        already adopted the blocks keep their own references. Returns blocks dropped fleet-wide."""
        tokens = self._tokens(prompt)
        total = 0
        for node in self.refresh_nodes():
            try:
                total += len(self.nodes.call(node, "evict_node", tenant, tokens, start)["block_ids"])
            except (NotFound, NodeGone):
                continue
        return total

    def close(self, tenant: str, session_id: str) -> None:
        """Drop the session's kernel and delete its op log; later calls raise NotFound. A close waits for a
        create, fork or rebuild of the session in flight in this fleet (the name's lock), and a rebuild in
        another controller never writes the record back (it writes only over the record it read). A close removes only
        the session whose record it read: one closed and created anew meanwhile by another controller stays."""
        with self._names.hold((tenant, session_id)):
            self._discard(self._stored(tenant, session_id))

    def release_session(self, tenant: str, session_id: str) -> None:
        """Drop the session's kernel from its host to free its KV memory (idle reaping); its record
        (state `idle`) and op log stay, so its next call regenerates it from the log."""
        with self._names.hold((tenant, session_id)):
            rec, raw = self._stored(tenant, session_id)
            self._where.pop((tenant, session_id), None)
            if rec.node in self.hosts:   # not the kernel of a session created anew meanwhile elsewhere
                self.nodes.call(rec.node, "close", tenant, session_id, None, rec.create_op_id or None)
            if rec.live:
                rec.released()
                self.registry.replace(rec, raw)  # not over a record closed (or rebuilt) meanwhile elsewhere

    def _discard(self, stored: Stored) -> None:
        """Close the session of the record read (`stored`): its kernel, then its op log, then its record (a crash
        half-way leaves the record, which a close removes again, never a kernel no record names). Each step
        removes only what that session's create or fork made (its op id): another controller may have closed the
        session and created its name anew meanwhile, and that session stays whole. NOTE: unconditional, a close
        that read the old record removed the new session's kernel, log and acknowledged record."""
        rec, raw = stored
        tenant, session_id, made = rec.tenant, rec.session, rec.create_op_id or None  # None: a record before op ids
        self._where.pop((tenant, session_id), None)
        self._close_kernel(rec.node, tenant, session_id, None, made)
        self._drop_log(tenant, session_id, made)
        while not self.registry.remove(tenant, session_id, raw):   # changed meanwhile (a rebuild, a release)
            now = self.registry.read(tenant, session_id)
            if now is None or now.rec.create_op_id != rec.create_op_id:
                return                                           # closed, or another session's now
            raw = now.raw

    # -- reads --------------------------------------------------------------------------------

    def digest(self, tenant: str, session_id: str) -> str:
        return str(self._call(tenant, session_id, SessionKernel.digest))

    def last_logits(self, tenant: str, session_id: str) -> np.ndarray | None:
        return self._call(tenant, session_id, SessionKernel.last_logits)  # type: ignore[no-any-return]

    def pieces(self, tenant: str, session_id: str) -> list[Any]:
        return list(self._call(tenant, session_id, SessionKernel.pieces))

    def tokens(self, tenant: str, session_id: str) -> list[int]:
        return list(self._call(tenant, session_id, SessionKernel.tokens))

    def info(self, tenant: str, session_id: str) -> dict[str, Any]:
        return dict(self._call(tenant, session_id, SessionKernel.info))

    def node_stats(self) -> list[dict[str, Any]]:
        """One row per alive node of the fleet (sessions, cache, KV budget used)."""
        return [row for row in self.nodes.ask_all("stats").values() if isinstance(row, dict)]

    def _answer(self, node: str, method: str, *args: Any) -> Any:
        """A host's answer, or None when its node is gone (it is dropped)."""
        try:
            return self.nodes.call(node, method, *args)
        except NodeGone:
            return None

    def list_sessions(self, fleet: bool = True, tenant: str | None = None) -> list[dict[str, Any]]:
        """Rows: session, tenant, node, host (its actor name, also as `actor`), pid, tokens, bytes alone/shared,
        hit rate, quarantined
        spans, state, epoch, last active. `fleet=False` lists only this process's node."""
        here = ray.get_runtime_context().get_node_id()
        sups = [n for n in self.refresh_nodes() if fleet or node_of(n) == here]
        ask = self.nodes.ask_all("rows", tenant) if fleet else {n: self._answer(n, "rows", tenant) for n in sups}
        live = {(r["tenant"], r["session"]): r for rows in ask.values() if isinstance(rows, list) for r in rows}
        out = []
        for rec in self.registry.records(tenant):
            if not fleet and rec.node not in sups:
                continue  # fleet=True also lists sessions whose node is gone (state: lost)
            held = live.get((rec.tenant, rec.session))
            row = {**rec.to_dict(), **(held or {"tokens": 0})}    # the host's counts over the record's
            row["state"] = LOST if rec.live and held is None else rec.state  # not held: lost until rebuilt
            row["hit_rate"] = row.get("adopted_tokens", 0) / row["tokens"] if row.get("tokens") else 0.0
            out.append(row)
        return out

    def reconcile(self) -> int:
        """Proactively regenerate every session that lost its kernel (instead of on its next call):
        its node left the cluster, its host answered without it (the host died and Ray restarted
        it empty), or a rebuild of it did not finish (`lost`: one that timed out is joined, not
        started over). Idle sessions stay idle. Returns how many were regenerated."""
        alive = set(self.refresh_nodes(force=True))
        ask = self.nodes.ask_all("rows")
        held = {(r["tenant"], r["session"]) for rows in ask.values() if isinstance(rows, list) for r in rows}
        answered = {nid for nid, rows in ask.items() if isinstance(rows, list)}
        lost = [r for r in self.registry.records() if r.state not in (CREATING, IDLE)
                and (r.state == LOST or r.node not in alive
                     or (r.node in answered and (r.tenant, r.session) not in held))]
        for rec in lost:
            self._where.pop((rec.tenant, rec.session), None)
        with ThreadPoolExecutor(RECONCILE_THREADS, thread_name_prefix="reconcile") as pool:  # the hosts' lanes run them
            rebuilt = list(pool.map(lambda r: self._rebuild(r.tenant, r.session)[1], lost))
        return sum(rebuilt)  # a host that was slow to list (held down) but holds its sessions rebuilds nothing

    def release(self) -> None:
        """Let go of the fleet without stopping it (a detached fleet's controller stopping):
        hosts and their sessions stay up for the next controller to reattach."""
        self.nodes.hosts = {}
        self.store.close()

    def shutdown(self) -> None:
        """Kill the kernel hosts (every session they hold goes with them); the logs stay."""
        for s in self.hosts.values():
            ray.kill(s, no_restart=True)
        self.nodes.hosts = {}
        self.store.close()
