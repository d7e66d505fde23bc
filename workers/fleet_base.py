"""The KernelFleet's parts and what its create, fork and close share (workers/fleet.py is the fleet's API): its
config, its nodes and their hosts (workers/nodes.py), its store and session registry, and the registry's rules for
one name: a create or fork claims a name free (clearing what a try that never completed left behind), and a try
that failed leaves nothing behind and removes nothing it did not make (its kernel, log and record, by its op id)."""

from __future__ import annotations

import threading
from typing import Any

import ray

from fleet.core.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from fleet.core.oplog import made_by, parse_log
from workers.name_locks import NameLocks
from workers.nodes import FleetNodes, NodeGone
from workers.placement import NODE_KV_BYTES, NODE_MAX_SESSIONS, RAY_NAMESPACE, delete_log, node_resources
from workers.registry import CREATING, SessionRecord, SessionRegistry, Stored
from workers.spec import KernelSpec, make_kernel, make_tokenizer


class FleetBase:
    """Sessions in kernel hosts (one Ray actor per node), state durable in the store: the parts (workers/fleet.py
    KernelFleet is the API)."""

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
        create or fork wrote). With no log, the references the session still holds: a close cut off after its log
        went (a retry), or a fork cut off before it wrote its log. NOTE: with no log, nothing was given back: the
        rest of a cut-off close's references, and those a cut-off fork took, stayed for good."""
        log = parse_log(self.store.oplog_read(tenant, session_id))
        if log and owner is not None and not made_by(log, owner):
            return
        delete_log(self.store, tenant, session_id, log)
