"""KernelHost: one Ray actor per node holds the kernels of many sessions (issue #29), and the node's
radix prefix cache.

    KernelFleet ──call(tenant, sid, verb, ...)──▶ KernelHost (one process per node; weights loaded once)
                                                   ├─ sessions: {(tenant, sid): SessionKernel}  (workers/session_kernel.py)
                                                   ├─ lanes: the host's threads, per-tenant FIFO lanes (workers/lanes.py)
                                                   └─ cache: RadixTree (values: ObjectRefs of blocks)  (workers/host_cache.py)
        create: match the prompt in the tree, the new session adopts the matched blocks (zero-copy,
                read-only views of this node's object store), then its new block-aligned blocks are
                ray.put once and inserted (LRU eviction under the node's budget)

A session is a few objects in this process, not a process of its own: a create costs no process start,
an idle session costs its KV bytes plus bookkeeping, and on a GPU node the host owns one CUDA context
(it asks Ray for the whole GPU). Sessions adopt shared blocks copy-on-write (`Kernel.session(prefix=...)`);
the radix key starts with a per-tenant salt page, so tenants never share.

A host that dies takes its sessions with it: Ray restarts it empty (`max_restarts`), and each session,
durable in its op log, is rebuilt on its next call (`SessionGone` tells the fleet) or by `reconcile()`
(`regenerate`, workers/host_restore.py, with forks).
A detached host outlives the controller, sessions and all, so a restarted controller finds them warm.
A kernel no registry record names (an orphan: its create's or fork's call timed out and the fleet cleaned up
before the host ran it) is replaced by the next create or fork of its name that the record names (`_insert`,
workers/host_slots.py), and a full host closes the ones no record names at all when placement asks it for room
(`offer`; workers/orphans.py).

Each node has a KV budget (`kv_budget_bytes`: the blocks its tree holds plus what its sessions hold
privately) and a session budget (`max_sessions`); placement asks every node for an `offer` and skips
the ones whose budget is spent.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleet.core.errors import InvalidArgument
from workers.host_cache import NodeCache
from workers.host_restore import HostRestores
from workers.lanes import TenantLanes, interpreter_bound
from workers.orphans import ORPHAN_SWEEP_S
from workers.placement import NODE_MAX_SESSIONS, fleet_scope, host_name
from workers.registry import SessionRegistry
from workers.session_kernel import SessionKernel
from workers.spec import KernelSpec, make_kernel, make_tokenizer, model_config, pin_threads

# The SessionKernel methods a fleet may call through `call` (its verbs and reads), nothing else.
VERBS = frozenset({
    "append_message", "append_output", "generate", "evict", "add_tool_result", "admit_tool_result",
    "working_set", "fork_point", "digest", "last_logits", "tokens", "pieces", "info", "snapshot", "stall", "unstall",
})


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class KernelHost(HostRestores):
    """The sessions of one node, in one process, and the node's prefix cache."""

    def __init__(self, node_id: str, store_url: str, kernel_spec: dict[str, Any],
                 budget_bytes: int = 64 << 20, policy: str = "lru", kv_budget_bytes: int = 2 << 30,
                 threads: int = 2, max_sessions: int = NODE_MAX_SESSIONS) -> None:
        """Args:
            node_id: the host's id: its Ray node's id (`:gpuN` added for a node's further GPUs,
                workers/placement.py `host_ids`); sessions and placement know the host by it.
            budget_bytes: the radix prefix cache's budget (part of `kv_budget_bytes`).
            kv_budget_bytes: the node's KV budget: cached blocks + the sessions' private blocks.
            threads: the host's kernel threads (its lanes); one tenant uses at most threads - 1 of them.
            max_sessions: the most sessions this host holds (placement skips a full host).
        """
        from fleet.cas import open_store

        self.node_id, self.store_url, self.kernel_spec = node_id, store_url, kernel_spec
        self.name = host_name(node_id, fleet_scope(store_url))
        spec = KernelSpec.from_dict(kernel_spec)
        self.block_size = spec.block_size
        self.bytes_per_token = model_config(spec).block_bytes(spec.block_size) // spec.block_size
        self.pid = os.getpid()
        self.base_resident = resident_bytes()
        self.lanes = TenantLanes(threads)  # NOTE: before the load, which measures the kernel for its CPU share
        # NOTE: the weights load in the background (seconds for torch or a checkpoint): the host answers
        # placement probes and listings at once, and the first session on it waits for them (`_kernel`).
        self._loading = ThreadPoolExecutor(1, thread_name_prefix="load").submit(self._load, spec)
        self.store = open_store(store_url)
        self.registry = SessionRegistry(self.store)  # read only: whether a record names a kernel (`_orphaned`)
        self.cache = NodeCache(self.block_size, self.bytes_per_token, budget_bytes, policy, self.lanes)
        self.kv_budget_bytes, self.max_sessions = kv_budget_bytes, max_sessions
        self.sessions: dict[tuple[str, str], SessionKernel] = {}
        self.remote_adopters: set[tuple[str, str]] = set()  # adopted blocks copied from another node
        self.reserved: dict[SessionKernel, int] = {}  # creates in flight: the KV bytes each was admitted for
        self.num_replays = 0  # op-log replays started here (regenerations, forks that replay)
        # session -> (epoch, its rebuild): a rebuild is the host's job, not its caller's (`regenerate`)
        self._rebuilds: dict[tuple[str, str], tuple[int, asyncio.Future[dict[str, Any]]]] = {}
        self._forks: dict[SessionKernel, asyncio.Future[dict[str, Any]]] = {}  # a fork's restore, which its retry joins
        self._swept_at = -ORPHAN_SWEEP_S  # event-loop time of the last sweep for orphans (`_sweep_for_room`)
        self._sweep: asyncio.Task[None] | None = None  # the last one

    def _load(self, spec: KernelSpec) -> tuple[Any, Any]:
        """The kernel (weights loaded once, for every session) and its tokenizer; then the resident
        memory the sessions' growth is measured from."""
        kernel = make_kernel(spec)
        pin_threads(kernel)
        tokenizer = make_tokenizer(kernel)
        self._measure_share(kernel)
        self.base_resident = resident_bytes()
        return kernel, tokenizer

    def _measure_share(self, kernel: Any) -> None:
        """The CPU share per tenant runs only on a numpy kernel bound by the interpreter lock (workers/lanes.py):
        measured here, once, on a 64-token append. A torch kernel releases the lock in its ops, and on a GPU the
        CPU is not what tenants share."""
        ids = [i % kernel.config.vocab_size for i in range(64)]
        bound, speedup = interpreter_bound(lambda: kernel.session().append(ids))
        self.lanes.share.speedup = speedup
        self.lanes.share.enabled = self.lanes.share.enabled and bound and kernel.backend == "numpy"

    # -- prefix cache (workers/host_cache.py) ---------------------------------------------------

    async def offer(self, tenant: str, tokens: list[int]) -> dict[str, Any]:
        """Placement probe (counts nothing): tokens of `tokens` this node holds warm, its number of
        sessions and its session budget, its KV bytes left (budget - cached blocks - sessions' private blocks), and
        its kernel's model_id (a lost session is rebuilt on a kernel of its own where one has room). A full host
        first closes its orphans that no record names (`_sweep_for_room`)."""
        if len(self.sessions) >= self.max_sessions:
            await self._sweep_for_room()
        return {"matched": self.cache.num_warm(tenant, tokens), "sessions": len(self.sessions),
                "max_sessions": self.max_sessions, "free_bytes": self.free_bytes(),
                "model_id": self._loaded_model_id()}

    def _loaded_model_id(self) -> str:
        """The kernel's model_id once its weights are loaded; "" while they load (a probe never waits for them)."""
        done = self._loading.done() and self._loading.exception() is None
        return str(self._loading.result()[0].model_id) if done else ""

    async def evict_node(self, tenant: str, tokens: list[int], start: int = 0) -> dict[str, Any]:
        """Policy eviction by name (`NodeCache.evict_node`)."""
        return self.cache.evict_node(tenant, tokens, start)

    # -- sessions (their slots: workers/host_slots.py; rebuilds and forks: workers/host_restore.py) ---------

    async def call(self, tenant: str, session_id: str, verb: str, *args: Any) -> Any:
        """One session's verb or read (`VERBS`), run by its SessionKernel.

        Raises:
            SessionGone: the host does not hold the session (closed, released, or the host restarted):
                the fleet rebuilds it from its op log and calls again."""
        if verb not in VERBS:
            raise InvalidArgument(f"{verb!r} is not a session verb of a kernel host")
        return await getattr(self._session(tenant, session_id), verb)(*args)

    async def create_session(self, tenant: str, session_id: str, tokens: list[int], op_id: str) -> dict[str, Any]:
        """Open the session here; it adopts the warm prefix instead of prefilling it.

        Args:
            tokens: the system prompt, encoded (its first piece, and the radix key).
        """
        s = await self._insert(tenant, session_id, op_id, tokens)   # ResourceExhausted: no room (KV or slots)
        try:
            node, refs = self.cache.adoptable(tenant, tokens)
            try:
                await s.create(tokens, refs, op_id)   # a retry that joined its try is answered from its log (op id)
            except BaseException:
                self._drop(s)
                raise
            finally:
                self.cache.tree.dec_lock_ref(node)
            self.cache.count_hits(tokens, refs)
            await self.cache.publish(tenant, tokens, s)
        finally:
            self.release(s)   # what it holds (and filed in the tree) counts from here on
        return {"adopted_tokens": s.num_adopted_tokens, "epoch": s.epoch, "model_id": str(s.kernel.model_id)}

    async def model_id(self) -> str:
        """This host's kernel's model_id: its weights, backend, device and CPU code path (Kernel.model_id)."""
        return str((await self._kernel())[0].model_id)

    async def close(self, tenant: str, session_id: str, owner: str | None = None,
                    create_op_id: str | None = None) -> None:
        """Drop the session's kernel (its KV memory is freed); an op in flight finishes first. With `owner`
        (a failed create's or fork's op id, a rebuild's token): only the session that try opened, never
        another's that holds the name now. With `create_op_id` (a close of the session its record names): only a
        kernel of that session (its create's or fork's, or a rebuild's of it), never one of a session created
        anew under its name meanwhile (by another controller)."""
        key = (tenant, session_id)
        s = self.sessions.get(key)
        if owner is not None and (s is None or s.owner != owner):
            return
        if create_op_id is not None and (s is None or s.create_op_id != create_op_id):
            return
        self.sessions.pop(key, None)
        self.remote_adopters.discard(key)
        self._rebuilds.pop(key, None)  # a later rebuild starts afresh, joins no closed one
        if s is not None:
            await s.close()

    async def stop(self) -> int:
        """Drop every session this host holds (their logs stay)."""
        sessions, self.sessions = list(self.sessions.values()), {}
        self._rebuilds.clear()
        for s in sessions:
            s.closed = True
        return len(sessions)

    async def rows(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """One info row per session this host holds (with the host's name, node and pid)."""
        return [s.info_row() for k, s in list(self.sessions.items()) if tenant is None or k[0] == tenant]

    async def ping(self) -> str:
        return "ok"

    async def holds(self, tenant: str, session_id: str) -> bool:
        return (tenant, session_id) in self.sessions

    async def stats(self) -> dict[str, Any]:
        kv, rss, c = sum(sum(s.memory()) for s in list(self.sessions.values())), resident_bytes(), self.cache
        return {"node": self.node_id, "host": self.name, "pid": self.pid, "sessions": len(self.sessions),
                "max_sessions": self.max_sessions, "cached_tokens": c.tree.num_cached_tokens,
                "capacity_tokens": c.tree.capacity_tokens, "kv_budget_bytes": self.kv_budget_bytes,
                "kv_used_bytes": self.used_bytes(), "sessions_kv_bytes": kv, "resident_bytes": rss,
                "session_bytes": max(0, rss - self.base_resident) // len(self.sessions) if self.sessions else 0,
                "queried_tokens": c.num_queried_tokens, "hit_tokens": c.num_hit_tokens,
                "evicted_blocks": c.num_evicted_blocks, "replays": self.num_replays, **{f"lanes_{k}": v for k, v in self.lanes.stats().items()},
                "hit_rate": c.num_hit_tokens / c.num_queried_tokens if c.num_queried_tokens else 0.0}
