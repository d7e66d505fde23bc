"""A kernel host's restores (workers/host.py's KernelHost takes these as a mixin): a lost session rebuilt from its op
log (`regenerate`), a fork opened from its parent's log and blocks (`fork`, and `share_prefix` on the parent's node
for a fork on another).

A restore is the host's job, not its caller's: it runs to the end even when its caller stops waiting, and a retry of
the same rebuild or fork joins the one still running (or gets its finished session's row) instead of replaying the
log again.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleet.core.errors import NotFound
from fleet.core.oplog import ForkOp, Op, kv_follows_tokens
from workers.host_slots import HostSlots
from workers.packed import unpack_ops
from workers.session_kernel import SessionKernel


def _read_log(packed: bytes) -> tuple[list[Op], bool]:
    """A fork's packed log, and whether its KV follows its tokens (`kv_follows_tokens`)."""
    ops = unpack_ops(packed)
    return ops, kv_follows_tokens(ops)


class HostRestores(HostSlots):
    """Rebuilds and forks of a host's sessions, each run once however often it is asked for."""

    num_replays: int
    _rebuilds: dict[tuple[str, str], tuple[int, asyncio.Future[dict[str, Any]]]]
    _forks: dict[SessionKernel, asyncio.Future[dict[str, Any]]]

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
        await self.cache.publish(tenant, tokens, parent)
        node, refs = self.cache.adoptable(tenant, tokens)
        self.cache.tree.dec_lock_ref(node)  # the caller's refs keep the objects alive from here on
        return {"model_id": parent.kernel.model_id, "refs": refs}

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
        With `tokens`, the child is admitted only while the node's KV budget has room for it (`_insert`): its tokens
        past the blocks it adopts from this node's tree; all of them when it replays or adopts another node's blocks.
        """
        ops, follows = await self.lanes.run(tenant, lambda: _read_log(packed))
        owner = ops[-1].op_id if ops and isinstance(ops[-1], ForkOp) else ""   # the fork's op id: its marker's
        # NOTE: `_insert` decides whether the child's name is free (an orphan held under it is replaced); an early
        # refusal here, before the parent's blocks were published, refused a fork where an orphan held the name
        if prefix_refs and tokens and follows:
            s = await self._insert(tenant, child_id, owner, tokens, adopts=False, files=False)   # copies: they count
            self.remote_adopters.add((tenant, child_id))
            return await self._restore(s, ops, prefix_refs, tokens, prefix_model_id)
        parent = self.sessions.get((tenant, parent_id)) if parent_id is not None else None
        if parent is None or not tokens or not follows:
            return await self._restore(await self._insert(tenant, child_id, owner, tokens, adopts=False, files=False),
                                       ops)
        await self.cache.publish(tenant, tokens, parent)          # the blocks the tree lacks, once
        s = await self._insert(tenant, child_id, owner, tokens, files=False)   # after the publish: it adopts them
        node, refs = self.cache.adoptable(tenant, tokens)
        try:
            return await self._restore(s, ops, refs, tokens)
        finally:
            self.cache.tree.dec_lock_ref(node)

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
        finally:
            self.release(s)   # what it holds counts from here on, not what it was admitted for
