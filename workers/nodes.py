"""The nodes a KernelFleet runs on: one host per alive Ray node that has the sessions'
resources, following Ray's node table (re-read at most every `refresh_s`, and at once after a failure),
placement of a new session among them, and calls to a node's host that survive its restarts.

A node dies before Ray's node table says so: its raylet is gone, but the table lists it alive
until the GCS health checks give up (seconds; 15 s with Ray's defaults). Meanwhile a call to its
host waits for a restart that cannot happen, then raises ActorUnschedulableError (the node
named by the hard node affinity is gone). So a node is held *down* here (`down`) as soon as
either shows: an ActorUnschedulableError (down until the table agrees, or `DOWN_HOLD_S`), or a
host that does not answer a ping within `PROBE_S` after a call to it failed (down for
`SUSPECT_S`, then asked again). A down node is not placed on, not listed, not asked: its sessions
are rebuilt on a live node on their next call (issue #31 item 2). Listings and placement ask every
node at once (`ask_all`), and stop waiting `PROBE_S` after the first answer: a node that has not
answered by then is held down too, so a dead node delays them by `PROBE_S` at most, once. A node
held down only for not answering keeps its host: a call naming it still waits for it (Ray may
be restarting it), and with no other node up, placement asks it anyway.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from typing import Any

import ray

from fleet.core.errors import KvfleetError, Unavailable
from workers.host import KernelHost
from workers.placement import (
    NODE_MAX_SESSIONS,
    RAY_NAMESPACE,
    NodeOffer,
    choose_node,
    eligible_nodes,
    fleet_scope,
    host_name,
    node_hosts,
    node_of,
    node_resources,
    on_node,
    previous_host_names,
)
from workers.spec import KernelSpec

log = logging.getLogger(__name__)

PROBE_S = 1.0  # how long a live host may take to answer a ping or a fan-out, after the first answer
SUSPECT_S = 10.0  # a node that did not answer is held down this long, then asked again
DOWN_HOLD_S = 120.0  # a node Ray could not schedule on is held down until its table agrees, at most this long


class NodeGone(Unavailable):
    """A node's host is dead (the node left the cluster); it has been dropped."""


class CallTimeout(Unavailable):
    """A host did not answer a call within the call timeout (it may still be running it): the caller that knows
    the call's session and verb says so (workers/call_timeout.py)."""


def ray_get(refs: Any, timeout_s: float) -> Any:
    """ray.get with the fleet's errors: a timeout is Unavailable, a kvfleet error raised in an actor is itself."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise CallTimeout(f"a worker did not answer within {timeout_s:g}s") from e
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, KvfleetError):
            raise e.cause from None
        raise


class FleetNodes:
    """The hosts, by Ray node id, and the kernel spec each node's group runs (workers/spec.py)."""

    def __init__(self, spec: KernelSpec, store_url: str, *, budget: int, policy: str, kv_bytes: int,
                 resources: dict[str, float], detached: bool, refresh_s: float, call_timeout_s: float,
                 bytes_per_token: int, max_sessions: int = NODE_MAX_SESSIONS, host_threads: int = 0) -> None:
        """Arguments as KernelFleet's (its docstring); `bytes_per_token` of the fleet's kernel."""
        self._max_sessions, self._host_threads = max_sessions, host_threads
        self.spec, self.store_url, self.call_timeout_s = spec, store_url, call_timeout_s
        self._budget, self._policy, self._kv_bytes = budget, policy, kv_bytes
        self._resources, self._detached, self.bytes_per_token = resources, detached, bytes_per_token
        self._refresh_s, self._refreshed = refresh_s, float("-inf")
        self._lock = threading.Lock()
        self.hosts: dict[str, Any] = {}
        self.specs: dict[str, KernelSpec] = {}  # node -> the kernel spec its group runs
        self.num_without_gpu = 0  # eligible nodes whose group's spec is CUDA but that have no GPU
        self.down: dict[str, float] = {}  # node -> time.monotonic() until which it is held down

    def refresh(self, force: bool = False) -> list[str]:
        """Follow Ray's node table: hosts for every alive node with the sessions' resources (new
        ones included: one, or one per GPU for a CUDA kernel), none for dead ones. Returns the host
        ids (a CPU node's host id is its node id: workers/placement.py `host_ids`)."""
        with self._lock:  # the servicer calls from many threads
            return self._refresh(force)

    def _refresh(self, force: bool) -> list[str]:
        now = time.monotonic()
        if not force and now - self._refreshed < self._refresh_s:
            return self._up()
        self._refreshed = now
        nodes = ray.nodes()  # type: ignore[no-untyped-call]
        specs = {n["NodeID"]: self.spec.for_node(n) for n in nodes}  # None: no GPU for a CUDA group
        eligible = eligible_nodes(nodes, node_resources(self._resources))
        res = {n["NodeID"]: n.get("Resources", {}) for n in nodes}
        nodes_up = [n for n in eligible if specs.get(n) is not None]
        self.num_without_gpu = len(eligible) - len(nodes_up)
        hosts: dict[str, tuple[KernelSpec, float]] = {}  # host id -> its spec and its share of the node's CPUs
        for nid in nodes_up:
            spec = specs[nid] or self.spec
            hosts.update({hid: (spec, cpus) for hid, cpus in node_hosts(nid, res[nid], spec.needs_gpu).items()})
        for hid in set(self.hosts) - set(hosts):
            self.hosts.pop(hid, None)
        for hid in [h for h, until in self.down.items() if h not in hosts or until <= now]:
            del self.down[hid]  # the table agrees it is dead (or the hold ran out: ask it again)
        for hid, (spec, cpus) in hosts.items():
            self.specs[hid] = spec
            if hid not in self.hosts and hid not in self.down:
                self.hosts[hid] = self._host(hid, spec, cpus)
        return self._up()

    def _up(self) -> list[str]:
        now = time.monotonic()
        return [n for n in self.hosts if self.down.get(n, 0.0) <= now]

    def hold_down(self, nid: str, seconds: float, *, drop: bool = False) -> None:
        """Treat `nid` as dead for `seconds` (`drop`: forget its host too: Ray cannot restart it)."""
        with self._lock:
            self.down[nid] = max(self.down.get(nid, 0.0), time.monotonic() + seconds)
            if drop:
                self.hosts.pop(nid, None)

    def _host(self, hid: str, spec: KernelSpec, cpus: float) -> Any:
        """A kernel host of a node: an existing one by name (a restarted controller reattaches), or a
        new one, running the node group's kernel spec (workers/spec.py) on `host_threads` threads
        (default: its share of the node's CPUs, at least 2, so one tenant always leaves another a thread).

        NOTE: it asks Ray for no CPU: its sessions are not Ray tasks, and a CPU reservation per host
        would only hide the node's cores from Ray's other work. A CUDA spec's host asks for a whole
        GPU (it owns the device); custom resources (`resources`) are asked for once, by the host."""
        threads = self._host_threads or max(2, int(cpus))
        return ray.remote(KernelHost).options(
            name=host_name(hid, fleet_scope(self.store_url)), namespace=RAY_NAMESPACE, get_if_exists=True,
            num_cpus=0, num_gpus=spec.host_gpus, resources=self._resources, max_concurrency=10_000,
            max_restarts=3, scheduling_strategy=on_node(node_of(hid)), lifetime="detached" if self._detached else None,
        ).remote(hid, self.store_url, spec.to_dict(), self._budget, self._policy, self._kv_bytes,
                 threads, self._max_sessions)

    def stop_previous_hosts(self) -> list[str]:
        """Kill this fleet's kernel hosts of a previous host API version (workers/placement.py `previous_host_names`);
        their names. A fleet never calls them (it names its hosts with its own version), and every session they hold
        is rebuilt from its op log on this version's host of its node on its next call, so nothing of theirs is
        needed; detached, they would hold their memory (a GPU node's whole GPU, which this version's host asks for)
        until the cluster stops. NOTE: they ran on after an upgrade, each a process with its sessions' KV."""
        actors = ray.util.list_named_actors(all_namespaces=True)
        names = [a["name"] for a in actors if a["namespace"] == RAY_NAMESPACE]
        stopped = []
        for name in previous_host_names(names, fleet_scope(self.store_url)):
            try:
                ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
            except ValueError:  # gone meanwhile (another controller stopped it)
                continue
            stopped.append(name)
        if stopped:
            log.info("stopped %d kernel host(s) of a previous host API version: %s", len(stopped), stopped)
        return stopped

    def place(self, tenant: str, tokens: list[int], exclude: str = "", model_id: str = "") -> str:
        """The node a new (or regenerated) session goes to; nodes that fail to answer are dropped. With
        `model_id` (a lost session's), a node whose kernel has it goes first (`choose_node`).

        Raises:
            ResourceExhausted: no node has room for the session's tokens."""
        answers = self.ask_all("offer", tenant, tokens, exclude=exclude)
        offers = [NodeOffer(nid, o["matched"], o["sessions"], o["free_bytes"], o["max_sessions"], o.get("model_id", ""))
                  for nid, o in answers.items() if not isinstance(o, Exception)]
        errors = [str(o) for o in answers.values() if isinstance(o, Exception)]
        if not offers and errors:  # not a full fleet: a fleet that does not answer
            raise Unavailable(f"no node's host answered ({len(errors)} nodes); the last: {errors[-1]}")
        return choose_node(offers, len(tokens), self.bytes_per_token, model_id)

    def ask_all(self, method: str, *args: Any, exclude: str = "") -> dict[str, Any]:
        """Every up node's answer to one host call, asked at once: node -> answer, or the
        exception it raised (a kvfleet error, or Unavailable). A node that has not answered
        `PROBE_S` after the first answer (or within the call timeout, if none answers) is held
        down and left out: one dead node never holds up a listing or a placement for long."""
        nodes = [n for n in self.refresh() if n != exclude]
        if not nodes:  # none up but nodes held down that still have a host (one restarting): ask them
            nodes = [n for n in list(self.down) if n != exclude and n in self.hosts]
        sups = {nid: self.hosts.get(nid) for nid in nodes}
        refs = {getattr(sup, method).remote(*args): nid for nid, sup in sups.items() if sup is not None}
        out: dict[str, Any] = {}
        replaced: set[str] = set()
        pending, deadline = list(refs), time.monotonic() + self.call_timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                nid = refs[ref]
                try:
                    out[nid] = ray_get(ref, self.call_timeout_s)
                except ray.exceptions.ActorUnschedulableError:
                    self.hold_down(nid, DOWN_HOLD_S, drop=True)
                except ray.exceptions.ActorUnavailableError:  # restarting: ask again (safe to repeat)
                    time.sleep(0.05)
                    again = getattr(sups[nid], method).remote(*args)
                    refs[again] = nid
                    pending.append(again)
                except ray.exceptions.RayActorError as e:  # dead: a live node gets its host back, once
                    again = self._replaced(nid) if nid not in replaced else None
                    replaced.add(nid)
                    if again is None:
                        out[nid] = Unavailable(f"the host of node {nid} did not answer: {str(e)[:200]}")
                        continue
                    sups[nid] = again
                    refs[again_ref := getattr(again, method).remote(*args)] = nid
                    pending.append(again_ref)
                except KvfleetError as e:
                    out[nid] = e
            if done:
                deadline = min(deadline, time.monotonic() + PROBE_S)
        for ref in pending:
            self.hold_down(refs[ref], SUSPECT_S)
            # NOTE: its answer, when it comes, lifts the hold: a host only late (still starting, or a loaded machine)
            # was refused by name ("not an alive node") and left out of every placement for the whole hold
            ref.future().add_done_callback(functools.partial(self._late_answer, refs[ref]))
        return out

    def _late_answer(self, nid: str, answer: concurrent.futures.Future[Any]) -> None:
        """A held-down node's host answered after all: up again (unless it failed, or Ray dropped it meanwhile)."""
        if answer.exception() is not None:
            return
        with self._lock:
            if nid in self.hosts:
                self.down.pop(nid, None)

    def alive(self, nid: str) -> bool:
        return nid in self.refresh()

    def _replaced(self, nid: str) -> Any:
        """After its host died: the node's new one (Ray's restart, or a new one) if the node is still up."""
        with self._lock:
            self.hosts.pop(nid, None)
        return self.hosts.get(nid) if self.alive_now(nid) else None

    def answers(self, nid: str) -> bool:
        """Whether `nid` is up and its host answers a ping within PROBE_S (else: held down).
        Asked before rebuilding a lost session where it was: its host died, maybe with its node."""
        sup = self.hosts.get(nid) if self.alive(nid) else None
        if sup is None:
            return False
        try:
            ray.get(sup.ping.remote(), timeout=PROBE_S)
            return True
        except ray.exceptions.ActorUnschedulableError:
            self.hold_down(nid, DOWN_HOLD_S, drop=True)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            self.hold_down(nid, SUSPECT_S)
        return False

    def call(self, node: str, method: str, *args: Any) -> Any:
        """Call a node's host; while Ray restarts it (ActorUnavailableError), retry until
        the call timeout (host calls are safe to repeat). A dead host, or one whose
        node left the node table, is dropped: NodeGone. A dead host on a node that is still
        alive (one that could not start, or exhausted its restarts) is replaced once."""
        deadline, replaced = time.monotonic() + self.call_timeout_s, False
        for attempt in itertools.count():
            sup = self.hosts.get(node)
            if sup is None:
                raise NodeGone(f"node {node} has left the cluster")
            try:
                return ray_get(getattr(sup, method).remote(*args), self.call_timeout_s)
            except ray.exceptions.ActorUnschedulableError:  # Ray cannot restart it: its node is gone
                self.hold_down(node, DOWN_HOLD_S, drop=True)
                raise NodeGone(f"node {node} has left the cluster (its host cannot be restarted)") from None
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"the host of node {node} stayed unavailable") from None
                if not self.alive_now(node):
                    raise NodeGone(f"node {node} has left the cluster") from None
                time.sleep(min(0.05 * (attempt + 1), 1.0))
            except ray.exceptions.RayActorError as e:
                self.hosts.pop(node, None)
                if replaced or not self.alive_now(node):   # an alive node gets a new host here
                    raise NodeGone(f"the host of node {node} is dead: {str(e)[:300]}") from None
                replaced = True
        raise AssertionError("unreachable")  # pragma: no cover

    def alive_now(self, node: str) -> bool:
        return node in self.refresh(force=True)
