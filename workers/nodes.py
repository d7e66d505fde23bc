"""The nodes a KernelFleet runs on: one supervisor per alive Ray node that has the session actor's
resources, following Ray's node table (re-read at most every `refresh_s`, and at once after a failure),
placement of a new session among them, and calls to a node's supervisor that survive its restarts.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import ray

from fleet.errors import KvfleetError, Unavailable
from workers.placement import (
    NAMESPACE,
    NodeOffer,
    choose_node,
    eligible_nodes,
    fleet_scope,
    on_node,
    session_resources,
    supervisor_name,
)
from workers.spec import KernelSpec
from workers.supervisor import NodeSupervisor


class NodeGone(Unavailable):
    """A node's supervisor is dead (the node left the cluster); it has been dropped."""


def ray_get(refs: Any, timeout_s: float) -> Any:
    """ray.get with the fleet's errors: a timeout is Unavailable, a kvfleet error raised in an actor is itself."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise Unavailable(f"a worker did not answer within {timeout_s:.0f}s") from e
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, KvfleetError):
            raise e.cause from None
        raise


class FleetNodes:
    """The supervisors, by Ray node id, and the kernel spec each node's group runs (workers/spec.py)."""

    def __init__(self, spec: KernelSpec, store_url: str, *, budget: int, policy: str, kv_bytes: int,
                 resources: dict[str, float], detached: bool, refresh_s: float, call_timeout_s: float,
                 bytes_per_token: int) -> None:
        """Arguments as KernelFleet's (its docstring); `bytes_per_token` of the fleet's kernel."""
        self.spec, self.store_url, self.call_timeout_s = spec, store_url, call_timeout_s
        self._budget, self._policy, self._kv_bytes = budget, policy, kv_bytes
        self._resources, self._detached, self.bytes_per_token = resources, detached, bytes_per_token
        self._refresh_s, self._refreshed = refresh_s, float("-inf")
        self._lock = threading.Lock()
        self.supervisors: dict[str, Any] = {}
        self.specs: dict[str, KernelSpec] = {}  # node -> the kernel spec its group runs
        self.num_without_gpu = 0  # eligible nodes whose group's spec is CUDA but that have no GPU

    def refresh(self, force: bool = False) -> list[str]:
        """Follow Ray's node table: a supervisor for every alive node with the session actor's
        resources (new ones included), none for dead ones. Returns the node ids."""
        with self._lock:  # the servicer calls from many threads
            return self._refresh(force)

    def _refresh(self, force: bool) -> list[str]:
        now = time.monotonic()
        if not force and now - self._refreshed < self._refresh_s:
            return list(self.supervisors)
        self._refreshed = now
        nodes = ray.nodes()  # type: ignore[no-untyped-call]
        specs = {n["NodeID"]: self.spec.for_node(n) for n in nodes}  # None: no GPU for a CUDA group
        eligible = eligible_nodes(nodes, session_resources(self._resources))
        alive = [n for n in eligible if specs.get(n) is not None]
        self.num_without_gpu = len(eligible) - len(alive)
        for nid in set(self.supervisors) - set(alive):
            self.supervisors.pop(nid, None)
        for nid in alive:
            self.specs[nid] = specs[nid] or self.spec
            if nid not in self.supervisors:
                self.supervisors[nid] = self._supervisor(nid, self.specs[nid])
        return list(self.supervisors)

    def _supervisor(self, nid: str, spec: KernelSpec) -> Any:
        """The node's supervisor: an existing one by name (a restarted controller reattaches), or a
        new one, running the node group's kernel spec (workers/spec.py)."""
        return ray.remote(NodeSupervisor).options(
            name=supervisor_name(nid, fleet_scope(self.store_url)), namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
            max_restarts=3, scheduling_strategy=on_node(nid), lifetime="detached" if self._detached else None,
        ).remote(nid, self.store_url, spec.to_dict(), self._budget, self._policy, self._kv_bytes,
                 self._resources, self._detached)

    def place(self, tenant: str, tokens: list[int], exclude: str = "") -> str:
        """The node a new (or regenerated) session goes to; nodes that fail to answer are dropped.

        Raises:
            ResourceExhausted: no node has room for the session's tokens."""
        offers, errors = [], []
        for nid in [n for n in self.refresh() if n != exclude]:
            try:
                o = self.call(nid, "offer", tenant, tokens)
            except Unavailable as e:
                errors.append(str(e))
                continue
            offers.append(NodeOffer(nid, o["matched"], o["sessions"], o["free_bytes"]))
        if not offers and errors:  # not a full fleet: a fleet that does not answer
            raise Unavailable(f"no node's supervisor answered ({len(errors)} nodes); the last: {errors[-1]}")
        return choose_node(offers, len(tokens), self.bytes_per_token)

    def alive(self, nid: str) -> bool:
        return nid in self.refresh()

    def call(self, node: str, method: str, *args: Any) -> Any:
        """Call a node's supervisor; while Ray restarts it (ActorUnavailableError), retry until
        the call timeout (supervisor calls are safe to repeat). A dead supervisor, or one whose
        node left the node table, is dropped: NodeGone. A dead supervisor on a node that is still
        alive (one that could not start, or exhausted its restarts) is replaced once."""
        deadline, replaced = time.monotonic() + self.call_timeout_s, False
        for attempt in itertools.count():
            sup = self.supervisors.get(node)
            if sup is None:
                raise NodeGone(f"node {node} has left the cluster")
            try:
                return ray_get(getattr(sup, method).remote(*args), self.call_timeout_s)
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"the supervisor of node {node} stayed unavailable") from None
                if not self.alive_now(node):
                    raise NodeGone(f"node {node} has left the cluster") from None
                time.sleep(min(0.05 * (attempt + 1), 1.0))
            except ray.exceptions.RayActorError as e:
                self.supervisors.pop(node, None)
                if replaced or not self.alive_now(node):   # an alive node gets a new supervisor here
                    raise NodeGone(f"the supervisor of node {node} is dead: {str(e)[:300]}") from None
                replaced = True
        raise AssertionError("unreachable")  # pragma: no cover

    def alive_now(self, node: str) -> bool:
        return node in self.refresh(force=True)
