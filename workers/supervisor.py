"""NodeSupervisor: one per Ray node; owns the node's session actors and its radix prefix cache.

    KernelFleet ──create──▶ NodeSupervisor(node) ──match_prefix──▶ RadixTree (values: ObjectRefs of blocks)
                                 │  spawn KernelActor on this node, hand it the matched block refs
                                 │  (zero-copy, read-only numpy views through Ray's object store)
                                 └─ export the new session's block-aligned prompt, ray.put each new
                                    block, insert into the tree (LRU eviction under the node budget)

Sessions adopt shared blocks copy-on-write (`Kernel.session(prefix=...)`), so a hit costs no
prefill; the radix key starts with a per-tenant salt page, so tenants never share.

Each node has a KV budget (`kv_budget_bytes`): the blocks its tree holds plus what its sessions
hold privately. Placement asks every node for an `offer` and skips the ones whose budget is spent.
A detached supervisor (and its detached session actors) outlives the controller; one that Ray
restarts finds its node's surviving session actors again through the store's session registry.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from fleet.errors import AlreadyExists, NotFound
from fleet.oplog import Op, kv_follows_tokens
from fleet.radix import RadixTree
from workers.placement import (
    ACTOR_CPUS,
    RAY_NAMESPACE,
    fleet_scope,
    on_node,
    session_actor_name,
    tenant_salt,
)
from workers.registry import SessionRegistry
from workers.session_actor import KernelActor
from workers.spec import KernelSpec, make_kernel


class NodeSupervisor:
    """Owns the session actors of one node (tree-of-actors) and the node's prefix cache."""

    def __init__(self, node_id: str, store_url: str, kernel_spec: dict[str, Any],
                 budget_bytes: int = 64 << 20, policy: str = "lru", kv_budget_bytes: int = 2 << 30,
                 resources: dict[str, float] | None = None, detached: bool = False) -> None:
        """Args:
            budget_bytes: the radix prefix cache's budget (part of `kv_budget_bytes`).
            kv_budget_bytes: the node's KV budget: cached blocks + the sessions' private blocks.
            resources: custom Ray resources each session actor asks for (beyond ACTOR_CPUS CPU).
            detached: session actors outlive this supervisor's owner (the controller).
        """
        self.node_id, self.store_url, self.kernel_spec = node_id, store_url, kernel_spec
        kernel = make_kernel(KernelSpec.from_dict(kernel_spec).host())  # geometry only: never a device
        self.block_size = kernel.block_size
        self.bytes_per_token = kernel.block_bytes // kernel.block_size
        capacity = max(budget_bytes // self.bytes_per_token, 2 * self.block_size)
        self.tree = RadixTree(page_size=self.block_size, capacity_tokens=capacity, policy=policy)
        self.kv_budget_bytes, self.resources, self.detached = kv_budget_bytes, dict(resources or {}), detached
        self.actors: dict[tuple[str, str], Any] = {}
        self.epochs: dict[tuple[str, str], int] = {}
        self.remote_adopters: set[tuple[str, str]] = set()  # adopted blocks copied from another node
        self.num_queried_tokens = self.num_hit_tokens = 0
        self.num_evicted_blocks = 0
        if detached:
            try:
                self._find_survivors()
            except Exception:  # noqa: BLE001 - best effort: an unknown session still answers by name
                logging.getLogger("kvfleet.workers").exception("supervisor %s: survivors not looked up", node_id)

    def _find_survivors(self) -> None:
        """After a restart of this supervisor: take back the node's live (detached) session
        actors, listed in the store's registry (nothing else knew them)."""
        from fleet.cas import open_store

        store = open_store(self.store_url)
        try:
            for rec in SessionRegistry(store).records():
                if rec.get("node") != self.node_id:
                    continue
                try:
                    name = session_actor_name(rec["tenant"], rec["session"], fleet_scope(self.store_url))
                    actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
                except ValueError:  # gone: regenerated on its next call
                    continue
                self.actors[(rec["tenant"], rec["session"])] = actor
                self.epochs[(rec["tenant"], rec["session"])] = int(rec.get("epoch", 0))
        finally:
            store.close()

    # -- prefix cache -------------------------------------------------------------------------

    def _key(self, tenant: str, tokens: list[int]) -> list[int]:
        return tenant_salt(tenant, self.block_size) + list(tokens)

    async def offer(self, tenant: str, tokens: list[int]) -> dict[str, int]:
        """Placement probe (counts nothing): tokens of `tokens` this node holds warm, its number
        of sessions, and its KV bytes left (budget - cached blocks - sessions' private blocks)."""
        m = self.tree.match_prefix(self._key(tenant, tokens), count=False)
        used = await self.used_bytes()
        return {"matched": max(0, m.num_matched - self.block_size), "sessions": len(self.actors),
                "free_bytes": self.kv_budget_bytes - used}

    async def used_bytes(self, timeout_s: float = 5.0) -> int:
        """KV bytes held on this node: the tree's blocks (each once, in the object store) plus every
        session's blocks except those it adopted from this node's tree (zero-copy views of the same;
        blocks a cross-node fork adopted were copied here, so they count)."""
        async def held(key: tuple[str, str], actor: Any) -> int:
            try:
                i = await asyncio.wait_for(actor.info.remote(), timeout_s)
            except Exception:  # noqa: BLE001 - a dead or stuck actor holds nothing we can count
                return 0
            adopted = 0 if key in self.remote_adopters else int(i["adopted_tokens"]) * self.bytes_per_token
            return max(0, int(i["bytes_alone"]) + int(i["bytes_shared"]) - adopted)

        private = await asyncio.gather(*(held(k, a) for k, a in list(self.actors.items())))
        salt = self.block_size * len(self.tree.root.children)   # one salt page per tenant: no KV
        return (self.tree.num_cached_tokens - salt) * self.bytes_per_token + sum(private)

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

    async def _publish(self, tenant: str, tokens: list[int], actor: Any) -> None:
        """Put the session's block-aligned `tokens` in the tree (only blocks the tree lacks).

        The key is the exported prefix's own tokens, so a session that moved on meanwhile (a fork
        point read earlier) never files blocks under tokens they do not hold."""
        n = len(tokens) - len(tokens) % self.block_size
        if n == 0 or self._num_cached_pages(self._key(tenant, tokens[:n])) >= n // self.block_size:
            return
        try:
            prefix = await actor.export_prefix.remote(n)      # zero-copy on this node
        except Exception:  # noqa: BLE001 - the session got shorter meanwhile: nothing to publish
            return
        key = self._key(tenant, list(prefix.tokens))
        have = self._num_cached_pages(key)                    # again: other creates ran meanwhile
        values = [None] * (1 + have) + [ray.put(b) for b in prefix.blocks[have:]]
        self.tree.insert(key, values)
        self._drain_events()

    def _num_cached_pages(self, key: list[int]) -> int:
        """Session pages of `key` already cached (the salt page not counted)."""
        return max(0, self.tree.match_prefix(key, count=False).num_matched // self.block_size - 1)

    def _drain_events(self) -> None:
        from fleet.radix import PagesRemoved

        self.num_evicted_blocks += sum(len(e.block_ids) for e in self.tree.take_events()
                                       if isinstance(e, PagesRemoved))

    async def evict_node(self, tenant: str, tokens: list[int], start: int = 0) -> dict[str, Any]:
        """Policy eviction by name: drop the tenant's cached blocks on this token path from
        position `start` (a block multiple) down, with everything cached below them, regardless
        of recency. Raises NotFound when the path is not cached here."""
        r = self.tree.evict_node(self._key(tenant, tokens), start=self.block_size + start)
        self._drain_events()
        return {"num_evicted": r.num_evicted, "block_ids": list(r.block_ids)}

    # -- session actors -----------------------------------------------------------------------

    def _spawn(self, tenant: str, session_id: str, epoch: int = 0) -> Any:
        """The session's actor on this node, at `epoch` (the registry's: KernelFleet counts them)."""
        key = (tenant, session_id)
        self.epochs[key] = epoch
        self.remote_adopters.discard(key)
        actor = ray.remote(KernelActor).options(
            name=session_actor_name(tenant, session_id, fleet_scope(self.store_url)), namespace=RAY_NAMESPACE, get_if_exists=True,
            num_cpus=ACTOR_CPUS, num_gpus=KernelSpec.from_dict(self.kernel_spec).actor_gpus, resources=self.resources,
            max_restarts=0, scheduling_strategy=on_node(self.node_id),
            lifetime="detached" if self.detached else None,
        ).remote(tenant, session_id, self.store_url, self.kernel_spec, self.node_id, self.epochs[key])
        self.actors[key] = actor
        return actor

    async def create_session(self, tenant: str, session_id: str, tokens: list[int], op_id: str) -> dict[str, Any]:
        """Spawn the session's actor here; it adopts the warm prefix instead of prefilling it.

        Args:
            tokens: the system prompt, encoded (its first piece, and the radix key).
        """
        if (tenant, session_id) in self.actors:
            raise AlreadyExists(f"session {session_id} already exists")
        node, refs = self._adoptable(tenant, tokens)
        try:
            actor = self._spawn(tenant, session_id)
            await actor.create.remote(tokens, refs, op_id)
        finally:
            self.tree.dec_lock_ref(node)
        self.num_queried_tokens += len(tokens)
        self.num_hit_tokens += len(refs) * self.block_size
        await self._publish(tenant, tokens, actor)
        return {"adopted_tokens": len(refs) * self.block_size, "epoch": self.epochs[(tenant, session_id)]}

    async def regenerate(self, tenant: str, session_id: str, epoch: int) -> dict[str, Any]:
        """Replace a lost actor by a new one at `epoch`, rebuilt from the op log (bit-identical)."""
        old = self.actors.pop((tenant, session_id), None)
        if old is not None:
            ray.kill(old, no_restart=True)
        for attempt in range(20):  # the dead actor's name is released asynchronously
            actor = self._spawn(tenant, session_id, epoch)
            try:
                return dict(await actor.restore.remote())
            except ray.exceptions.RayActorError:
                self.actors.pop((tenant, session_id), None)
                await asyncio.sleep(0.05 * (attempt + 1))
        raise NotFound(f"session {session_id}: could not regenerate its actor")

    async def share_prefix(self, tenant: str, session_id: str, tokens: list[int]) -> list[Any]:
        """The ObjectRefs of a live session's blocks at its fork point (`tokens`), for a fork on
        another node: Ray moves them there through the object store (at most len - 1 tokens, so
        the child computes its own last logits). Raises NotFound when the session is not here."""
        parent = self.actors.get((tenant, session_id))
        if parent is None:
            raise NotFound(f"session {session_id} is not on node {self.node_id}")
        await self._publish(tenant, tokens, parent)
        node, refs = self._adoptable(tenant, tokens)
        self.tree.dec_lock_ref(node)  # the caller's refs keep the objects alive from here on
        return refs

    async def fork(self, tenant: str, ops: list[Op], child_id: str, parent_id: str | None = None,
                   tokens: list[int] | None = None, prefix_refs: list[Any] | None = None) -> dict[str, Any]:
        """A branch in its own actor: `ops` (the parent's log + a fork marker) become its log.

        With `parent_id` (a live session on this node) and `tokens` (its tokens at the fork
        point), the branch shares the parent's blocks copy-on-write instead of recomputing them:

            parent actor ──export_prefix──▶ radix tree (ray.put once per block, per node)
                                               │ match salt(tenant) + tokens, lock
            child actor  ◀──block refs──────────┘ adopts them zero-copy, replays the ledger only,
                                                 computes the last 1..block_size tokens itself

        N forks of a long prefix then hold the prefix once (in the object store) plus N suffixes.
        With `prefix_refs` instead (the parent lives on another node: its supervisor's
        `share_prefix`), the child adopts those blocks, which Ray fetches from the parent's node.
        Without either (the parent is gone) the child replays the log.
        """
        if (tenant, child_id) in self.actors:
            raise AlreadyExists(f"session {child_id} already exists")
        if prefix_refs and tokens and kv_follows_tokens(ops):
            actor = self._spawn(tenant, child_id)
            self.remote_adopters.add((tenant, child_id))
            return dict(await actor.restore.remote(ops, prefix_refs, tokens))
        parent = self.actors.get((tenant, parent_id)) if parent_id is not None else None
        if parent is None or not tokens or not kv_follows_tokens(ops):
            return dict(await self._spawn(tenant, child_id).restore.remote(ops))
        await self._publish(tenant, tokens, parent)          # the blocks the tree lacks, once
        node, refs = self._adoptable(tenant, tokens)
        try:
            actor = self._spawn(tenant, child_id)
            out = dict(await actor.restore.remote(ops, refs, tokens))
        finally:
            self.tree.dec_lock_ref(node)
        return out

    async def close(self, tenant: str, session_id: str) -> None:
        actor = self.actors.pop((tenant, session_id), None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    async def stop(self) -> int:
        """Kill every session actor of this node (detached ones do not die with their owner)."""
        actors, self.actors = list(self.actors.values()), {}
        for actor in actors:
            ray.kill(actor, no_restart=True)
        return len(actors)

    async def rows(self, tenant: str | None = None, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """One info row per live session actor on this node (sessions that do not answer: lost)."""
        keys = [k for k in self.actors if tenant is None or k[0] == tenant]
        refs = [self.actors[k].info.remote() for k in keys]
        out = []
        for key, ref in zip(keys, refs, strict=True):
            try:
                out.append(dict(await asyncio.wait_for(ref, timeout_s)))
            except Exception:  # noqa: BLE001 - dead or stuck: reported, never waited on forever
                out.append({"session": key[1], "tenant": key[0], "node": self.node_id, "state": "lost",
                            "actor": session_actor_name(*key, fleet_scope(self.store_url)), "epoch": self.epochs.get(key, 0)})
        return out

    async def ping(self) -> str:
        return "ok"

    async def stats(self) -> dict[str, Any]:
        return {"node": self.node_id, "pid": os.getpid(), "sessions": len(self.actors), "cached_tokens": self.tree.num_cached_tokens,
                "capacity_tokens": self.tree.capacity_tokens, "kv_budget_bytes": self.kv_budget_bytes,
                "kv_used_bytes": await self.used_bytes(), "queried_tokens": self.num_queried_tokens,
                "hit_tokens": self.num_hit_tokens, "evicted_blocks": self.num_evicted_blocks,
                "hit_rate": self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0}

