"""KernelHost: one Ray actor per node holds the kernels of many sessions (issue #29), and the node's
radix prefix cache.

    KernelFleet ──call(tenant, sid, verb, ...)──▶ KernelHost (one process per node; weights loaded once)
                                                   ├─ sessions: {(tenant, sid): SessionKernel}  (workers/session_kernel.py)
                                                   ├─ lanes: the host's threads, per-tenant FIFO lanes (workers/lanes.py)
                                                   └─ RadixTree (values: ObjectRefs of blocks)
        create: match the prompt in the tree, the new session adopts the matched blocks (zero-copy,
                read-only views of this node's object store), then its new block-aligned blocks are
                ray.put once and inserted (LRU eviction under the node's budget)

A session is a few objects in this process, not a process of its own: a create costs no process start,
an idle session costs its KV bytes plus bookkeeping, and on a GPU node the host owns one CUDA context
(it asks Ray for the whole GPU). Sessions adopt shared blocks copy-on-write (`Kernel.session(prefix=...)`);
the radix key starts with a per-tenant salt page, so tenants never share.

A host that dies takes its sessions with it: Ray restarts it empty (`max_restarts`), and each session,
durable in its op log, is rebuilt on its next call (`SessionGone` tells the fleet) or by `reconcile()`.
A detached host outlives the controller, sessions and all, so a restarted controller finds them warm.
A kernel no registry record names (an orphan: its create's or fork's call timed out and the fleet cleaned up
before the host ran it) is replaced by the next create or fork of its name that the record names (`_insert`),
and a full host closes the ones no record names at all when placement asks it for room (`offer`).

Each node has a KV budget (`kv_budget_bytes`: the blocks its tree holds plus what its sessions hold
privately) and a session budget (`max_sessions`); placement asks every node for an `offer` and skips
the ones whose budget is spent.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from fleet.core.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from fleet.core.oplog import ForkOp, Op, kv_follows_tokens
from fleet.core.radix import RadixTree
from workers.lanes import TenantLanes, interpreter_bound
from workers.orphans import ORPHAN_SWEEP_S, Orphans
from workers.packed import unpack_ops
from workers.placement import NODE_MAX_SESSIONS, fleet_scope, host_name, tenant_salt
from workers.registry import SessionRegistry
from workers.session_kernel import SessionGone, SessionKernel
from workers.spec import KernelSpec, make_kernel, make_tokenizer, model_config, pin_threads

# The SessionKernel methods a fleet may call through `call` (its verbs and reads), nothing else.
VERBS = frozenset({
    "append_message", "append_output", "generate", "evict", "add_tool_result", "admit_tool_result",
    "working_set", "fork_point", "digest", "last_logits", "tokens", "pieces", "info", "stall", "unstall",
})
ORPHAN_TRIES = 3  # looks at a name a create or fork finds held (an orphan replaced, or the holder changed meanwhile)


def check_evict_start(start: Any, block_size: int, num_tokens: int) -> None:
    """The one rule for a policy eviction's `start`: an int (not a bool), a block multiple, inside the path's
    `num_tokens` tokens. NOTE: the host puts the tenant's salt page in front of the path and shifts `start` by
    one block; unchecked, `start=-block_size` named the salt page, and the eviction dropped every block the
    tenant had cached on the node, for every prompt."""
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < num_tokens or start % block_size:
        raise InvalidArgument(f"evict_prefix: start must be a multiple of the block size {block_size} in "
                              f"[0, {num_tokens}) (the prompt's tokens), got {start!r}; nothing was evicted")


def _read_log(packed: bytes) -> tuple[list[Op], bool]:
    """A fork's packed log, and whether its KV follows its tokens (`kv_follows_tokens`)."""
    ops = unpack_ops(packed)
    return ops, kv_follows_tokens(ops)


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class KernelHost(Orphans):
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
        capacity = max(budget_bytes // self.bytes_per_token, 2 * self.block_size)
        self.tree = RadixTree(page_size=self.block_size, capacity_tokens=capacity, policy=policy)
        self.kv_budget_bytes, self.max_sessions = kv_budget_bytes, max_sessions
        self.sessions: dict[tuple[str, str], SessionKernel] = {}
        self.remote_adopters: set[tuple[str, str]] = set()  # adopted blocks copied from another node
        self.num_queried_tokens = self.num_hit_tokens = 0
        self.num_evicted_blocks = 0
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

    async def _kernel(self) -> tuple[Any, Any]:
        return await asyncio.wrap_future(self._loading)

    # -- prefix cache -------------------------------------------------------------------------

    def _key(self, tenant: str, tokens: list[int]) -> list[int]:
        return tenant_salt(tenant, self.block_size) + list(tokens)

    async def offer(self, tenant: str, tokens: list[int]) -> dict[str, Any]:
        """Placement probe (counts nothing): tokens of `tokens` this node holds warm, its number of
        sessions and its session budget, its KV bytes left (budget - cached blocks - sessions' private blocks), and
        its kernel's model_id (a lost session is rebuilt on a kernel of its own where one has room). A full host
        first closes its orphans that no record names (`_sweep_for_room`)."""
        if len(self.sessions) >= self.max_sessions:
            await self._sweep_for_room()
        m = self.tree.match_prefix(self._key(tenant, tokens), count=False)
        return {"matched": max(0, m.num_matched - self.block_size), "sessions": len(self.sessions),
                "max_sessions": self.max_sessions, "free_bytes": self.kv_budget_bytes - self.used_bytes(),
                "model_id": self._loaded_model_id()}

    def _loaded_model_id(self) -> str:
        """The kernel's model_id once its weights are loaded; "" while they load (a probe never waits for them)."""
        done = self._loading.done() and self._loading.exception() is None
        return str(self._loading.result()[0].model_id) if done else ""

    def _held(self, key: tuple[str, str], s: SessionKernel) -> int:
        """KV bytes a session holds privately: its blocks except those adopted from this node's tree
        (views of the same; blocks a cross-node fork adopted were copied here, so they count)."""
        i = s.memory()
        adopted = 0 if key in self.remote_adopters else s.num_adopted_tokens * self.bytes_per_token
        return max(0, i[0] + i[1] - adopted)

    def used_bytes(self) -> int:
        """KV bytes held on this node: the tree's blocks (each once, in the object store) plus every
        session's private blocks."""
        salt = self.block_size * len(self.tree.root.children)   # one salt page per tenant: no KV
        private = sum(self._held(k, s) for k, s in list(self.sessions.items()))
        return (self.tree.num_cached_tokens - salt) * self.bytes_per_token + private

    def _adoptable(self, tenant: str, tokens: list[int]) -> tuple[Any, list[Any]]:
        """Lock and return the cached blocks a new session may adopt (at most len - 1 tokens,
        so the session computes its own last logits)."""
        m = self.tree.match_prefix(self._key(tenant, tokens), count=False)
        limit = (len(tokens) - 1) // self.block_size
        refs = []
        for v in m.values[1:1 + limit]:  # a page inserted without a value ends what can be adopted
            if v is None:
                break
            refs.append(v)
        self.tree.inc_lock_ref(m.node)
        return m.node, refs

    async def _publish(self, tenant: str, tokens: list[int], s: SessionKernel) -> None:
        """Put the session's block-aligned `tokens` in the tree (only blocks the tree lacks).

        The key is the exported prefix's own tokens, so a session that moved on meanwhile (a fork
        point read earlier) never files blocks under tokens they do not hold; and a session whose KV no
        longer follows its tokens (a reposition eviction re-rotated it) exports nothing
        (`SessionKernel.export_prefix`), so every block in the tree is what a prefill of its tokens computes."""
        n = len(tokens) - len(tokens) % self.block_size
        if n == 0 or self._num_cached_pages(self._key(tenant, tokens[:n])) >= n // self.block_size:
            return
        try:
            prefix = await s.export_prefix(n)
        except Exception:  # noqa: BLE001 - it got shorter, was re-rotated or closed meanwhile: nothing to publish
            return
        key = self._key(tenant, list(prefix.tokens))
        have = self._num_cached_pages(key)                    # again: other creates ran meanwhile
        # NOTE: the puts run on the tenant's lane: one per block on the host's loop held it 250-340 ms for a
        # 7k-token prompt, and every other tenant's calls on the host waited (append 6.7 -> 460 ms at worst)
        refs = await self.lanes.run(tenant, lambda: [ray.put(b) for b in prefix.blocks[have:]])
        now = self._num_cached_pages(key)                     # and again: the loop served others meanwhile
        values = [None] * (1 + max(have, now)) + refs[max(0, now - have):]
        self.tree.insert(key, values)
        self._drain_events()

    def _num_cached_pages(self, key: list[int]) -> int:
        """Session pages of `key` already cached (the salt page not counted)."""
        return max(0, self.tree.match_prefix(key, count=False).num_matched // self.block_size - 1)

    def _drain_events(self) -> None:
        from fleet.core.radix import PagesRemoved

        self.num_evicted_blocks += sum(len(e.block_ids) for e in self.tree.take_events()
                                       if isinstance(e, PagesRemoved))

    async def evict_node(self, tenant: str, tokens: list[int], start: int = 0) -> dict[str, Any]:
        """Policy eviction by name: drop the tenant's cached blocks on this token path from
        position `start` (a block multiple inside `tokens`) down, with everything cached below them,
        regardless of recency. Raises NotFound when the path is not cached here, InvalidArgument for a
        `start` outside it (`check_evict_start`: nothing is dropped)."""
        check_evict_start(start, self.block_size, len(tokens))
        r = self.tree.evict_node(self._key(tenant, tokens), start=self.block_size + start)
        self._drain_events()
        return {"num_evicted": r.num_evicted, "block_ids": list(r.block_ids)}

    # -- sessions -----------------------------------------------------------------------------

    async def _open(self, tenant: str, session_id: str, epoch: int, owner: str, create_op_id: str) -> SessionKernel:
        """A new, empty SessionKernel for a rebuild of the session at `epoch` (the registry's: KernelFleet
        counts them), in place of the one the host holds (a torn or older one); `create_op_id`: the session's.
        A rebuild that would take a new slot of a full host is refused (ResourceExhausted: the fleet places it
        again). NOTE: it was not: a session rebuilt on its own host after that host filled up overfilled it."""
        kernel, tokenizer = await self._kernel()
        if (tenant, session_id) not in self.sessions:
            self._check_room()  # one in place of the session's own kernel takes no new room
        old = self.sessions.pop((tenant, session_id), None)
        if old is not None:
            old.closed = True
        return self._put(tenant, session_id, kernel, tokenizer, epoch, owner, create_op_id)

    async def _insert(self, tenant: str, session_id: str, owner: str) -> SessionKernel:
        """A new, empty SessionKernel for a create or fork (`owner`: its op id), refused while the host holds
        the session: AlreadyExists. The check and the insert run with no await between them, so of two tries
        of one name (two callers, two controllers) one gets the name and the other is refused; neither replaces
        the other's session. A retry of the same try (nodes.call repeats a call Ray may have run) gets the
        session that try opened. NOTE: the check was made before the kernel's load was awaited, and the session
        opened after it replaced whatever another try had opened meanwhile.

        One exception: a held kernel no record names, while the session's record names this try (an orphan,
        `_orphaned`), is closed with its log and the try goes on (`_replace_orphan`). The registry decides, as it
        does between controllers (its compare-and-set): the record names one try of a name at a time."""
        kernel, tokenizer = await self._kernel()
        key = (tenant, session_id)
        for _ in range(ORPHAN_TRIES):
            held = self.sessions.get(key)
            if held is None:
                self._check_room()  # a retry that joins its try's session below takes no new room
                return self._put(tenant, session_id, kernel, tokenizer, 0, owner)
            if owner and held.owner == owner and not held.closed:
                return held
            if not await self._orphaned(held, owner):
                break
            if self.sessions.get(key) is held:  # else it changed while the registry was read: look again
                await self._replace_orphan(held)
        raise AlreadyExists(f"session {session_id} already exists")

    def _put(self, tenant: str, session_id: str, kernel: Any, tokenizer: Any, epoch: int, owner: str,
             create_op_id: str = "") -> SessionKernel:
        key = (tenant, session_id)
        self.remote_adopters.discard(key)
        s = SessionKernel(tenant, session_id, kernel, tokenizer, self.store, self.lanes.run, node_id=self.node_id,
                          epoch=epoch, host=self.name, pid=self.pid, owner=owner, create_op_id=create_op_id)
        self.sessions[key] = s
        return s

    def _check_room(self) -> None:
        """ResourceExhausted when this host holds its most sessions (`max_sessions`). Placement skips a full host;
        this refuses a create, fork or rebuild that reaches it all the same (a fork that names its node, a rebuild
        on the session's own host, a placement that raced another for the last slot)."""
        if len(self.sessions) >= self.max_sessions:
            raise ResourceExhausted(f"the kernel host of node {self.node_id} holds its most sessions "
                                    f"({self.max_sessions}): close idle sessions, add nodes, or raise --node-max-sessions")

    def _drop(self, s: SessionKernel) -> None:
        """A try that failed removes the session it opened, if the host still holds that one (never the
        session of another try that holds the name now); a retry that joined it is refused."""
        key = (s.tenant, s.session_id)
        if self.sessions.get(key) is s:
            del self.sessions[key]
            self.remote_adopters.discard(key)
        s.closed = True

    def _session(self, tenant: str, session_id: str) -> SessionKernel:
        s = self.sessions.get((tenant, session_id))
        if s is None:
            raise SessionGone(f"session {session_id} is not held by host {self.name}")
        return s

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
        s = await self._insert(tenant, session_id, op_id)
        node, refs = self._adoptable(tenant, tokens)
        try:
            await s.create(tokens, refs, op_id)   # a retry that joined its try is answered from its log (op id)
        except BaseException:
            self._drop(s)
            raise
        finally:
            self.tree.dec_lock_ref(node)
        self.num_queried_tokens += len(tokens)
        self.num_hit_tokens += len(refs) * self.block_size
        await self._publish(tenant, tokens, s)
        return {"adopted_tokens": s.num_adopted_tokens, "epoch": s.epoch, "model_id": str(s.kernel.model_id)}

    async def regenerate(self, tenant: str, session_id: str, epoch: int, owner: str = "",
                         create_op_id: str = "") -> dict[str, Any]:
        """Rebuild a lost session here at `epoch`, from its op log (bit-identical); its info row. `owner`: the
        rebuild's token (the session it opens carries it: `close(..., owner)` removes that one alone);
        `create_op_id`: the session's (its record's), which a close of the session names (`close(..., None, id)`).

        The rebuild is the host's job, not its caller's: it runs to the end even when the caller
        stops waiting (its call timed out during a long replay), and a later call for the same
        session and epoch joins the replay still running, or gets the rebuilt session's row at
        once, instead of throwing it away and replaying the whole log again. A call at another
        epoch (a later loss) starts a rebuild of its own."""
        key = (tenant, session_id)
        job = self._rebuilds.get(key)
        if job is not None and job[0] == epoch:
            return dict(await asyncio.shield(job[1]))
        s = self.sessions.get(key)
        if s is not None and s.epoch == epoch and s.ctx is not None and not s.closed:
            return s.info_row()                     # rebuilt at this epoch already (its caller gave up)
        task = asyncio.ensure_future(self._regenerate(tenant, session_id, epoch, owner, create_op_id))
        self._rebuilds[key] = (epoch, task)

        def done(t: asyncio.Future[dict[str, Any]]) -> None:
            if self._rebuilds.get(key, (epoch, None))[1] is t:
                del self._rebuilds[key]

        task.add_done_callback(done)
        return dict(await asyncio.shield(task))

    async def _regenerate(self, tenant: str, session_id: str, epoch: int, owner: str,
                          create_op_id: str) -> dict[str, Any]:
        s = await self._open(tenant, session_id, epoch, owner, create_op_id)
        self.num_replays += 1
        try:
            return dict(await s.restore())   # SessionGone when it was closed meanwhile
        except BaseException:
            self._drop(s)                    # not a later rebuild's session
            raise

    async def share_prefix(self, tenant: str, session_id: str, tokens: list[int]) -> dict[str, Any]:
        """The ObjectRefs of a live session's blocks at its fork point (`tokens`), for a fork on
        another node (`refs`: Ray moves them there through the object store; at most len - 1 tokens,
        so the child computes its own last logits), and the model_id of the kernel that computed them
        (`model_id`: the child's host adopts them only under the same one). Raises NotFound when the
        session is not here.

        The refs are the tree's blocks of `tokens`: the session's own, published here unless its KV no
        longer follows its tokens (then only what the tree already held: blocks a prefill of those tokens
        computed, never its re-rotated ones)."""
        parent = self.sessions.get((tenant, session_id))
        if parent is None:
            raise NotFound(f"session {session_id} is not on node {self.node_id}")
        await self._publish(tenant, tokens, parent)
        node, refs = self._adoptable(tenant, tokens)
        self.tree.dec_lock_ref(node)  # the caller's refs keep the objects alive from here on
        return {"model_id": parent.kernel.model_id, "refs": refs}

    async def model_id(self) -> str:
        """This host's kernel's model_id: its weights, backend, device and CPU code path (Kernel.model_id)."""
        return str((await self._kernel())[0].model_id)

    async def fork(self, tenant: str, packed: bytes, child_id: str, parent_id: str | None = None,
                   tokens: list[int] | None = None, prefix_refs: list[Any] | None = None,
                   prefix_model_id: str | None = None) -> dict[str, Any]:
        """A branch, isolated from its parent: `packed` (the parent's log + a fork marker, workers/packed.py)
        becomes its log. It is unpacked, and read, on the tenant's lane: a log of 200,000 ops took the host's event
        loop most of a second, every other tenant's call on the host waiting.

        With `parent_id` (a live session on this host) and `tokens` (its tokens at the fork
        point), the branch shares the parent's blocks copy-on-write instead of recomputing them:

            parent ──export_prefix──▶ radix tree (ray.put once per block, per node)
                                         │ match salt(tenant) + tokens, lock
            child  ◀──block refs──────────┘ adopts them zero-copy, replays the ledger only,
                                           computes the last 1..block_size tokens itself

        N forks of a long prefix then hold the prefix once (in the object store) plus N suffixes.
        With `prefix_refs` instead (the parent lives on another node: its host's `share_prefix`, and
        `prefix_model_id` the kernel that computed them), the child adopts those blocks, which Ray
        fetches from the parent's node. Without either (the parent is gone) the child replays the log.
        """
        ops, follows = await self.lanes.run(tenant, lambda: _read_log(packed))
        owner = ops[-1].op_id if ops and isinstance(ops[-1], ForkOp) else ""   # the fork's op id: its marker's
        # NOTE: `_insert` decides whether the child's name is free (an orphan held under it is replaced); an early
        # refusal here, before the parent's blocks were published, refused a fork where an orphan held the name
        if prefix_refs and tokens and follows:
            s = await self._insert(tenant, child_id, owner)
            self.remote_adopters.add((tenant, child_id))
            return await self._restore(s, ops, prefix_refs, tokens, prefix_model_id)
        parent = self.sessions.get((tenant, parent_id)) if parent_id is not None else None
        if parent is None or not tokens or not follows:
            return await self._restore(await self._insert(tenant, child_id, owner), ops)
        await self._publish(tenant, tokens, parent)          # the blocks the tree lacks, once
        s = await self._insert(tenant, child_id, owner)
        node, refs = self._adoptable(tenant, tokens)
        try:
            return await self._restore(s, ops, refs, tokens)
        finally:
            self.tree.dec_lock_ref(node)

    async def _restore(self, s: SessionKernel, *args: Any) -> dict[str, Any]:
        """Restore the fork's session `s` once: a retry of the same try (which `_insert` joined to `s`) awaits the
        first try's restore, or gets its row once done. NOTE: a joined retry restored it again: the child's log
        was written back (an op logged since was lost) and the parent's blob references were taken twice."""
        job = self._forks.get(s)
        if job is not None:
            return dict(await asyncio.shield(job))
        if s.ctx is not None:
            return s.info_row()
        task = asyncio.ensure_future(self._restore_once(s, *args))
        self._forks[s] = task
        task.add_done_callback(lambda _: self._forks.pop(s, None))
        return dict(await asyncio.shield(task))

    async def _restore_once(self, s: SessionKernel, *args: Any) -> dict[str, Any]:
        self.num_replays += 1
        try:
            return dict(await s.restore(*args))
        except BaseException:
            self._drop(s)
            raise

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
        kv, rss = sum(sum(s.memory()) for s in list(self.sessions.values())), resident_bytes()
        return {"node": self.node_id, "host": self.name, "pid": self.pid, "sessions": len(self.sessions),
                "max_sessions": self.max_sessions, "cached_tokens": self.tree.num_cached_tokens,
                "capacity_tokens": self.tree.capacity_tokens, "kv_budget_bytes": self.kv_budget_bytes,
                "kv_used_bytes": self.used_bytes(), "sessions_kv_bytes": kv, "resident_bytes": rss,
                "session_bytes": max(0, rss - self.base_resident) // len(self.sessions) if self.sessions else 0,
                "queried_tokens": self.num_queried_tokens, "hit_tokens": self.num_hit_tokens,
                "evicted_blocks": self.num_evicted_blocks, "replays": self.num_replays, **{f"lanes_{k}": v for k, v in self.lanes.stats().items()},
                "hit_rate": self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0}
