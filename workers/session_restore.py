"""A session rebuilt from its op log (workers/session_kernel.py's SessionKernel takes these as a mixin): a regeneration
after its host lost it, or a fork that writes its parent's log as its own first; either may adopt blocks another
session computed (the node's radix tree, or a parent on another node) instead of computing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from fleet.core.context import SessionContext
from fleet.core.errors import FailedPrecondition, NotFound
from fleet.core.kernel import Kernel, PrefixKV
from fleet.core.oplog import Op, history_tokens, own_op_fps, parse_log
from workers.placement import write_fork_log
from workers.session_ops import SessionGone, SessionOps


class SessionRestore(SessionOps):
    """Replaying a session's op log into a fresh context (`restore`), and the shared blocks it adopts."""

    kernel: Kernel
    tokenizer: Any
    num_adopted_tokens: int
    num_replayed_ops: int

    if TYPE_CHECKING:
        def info_row(self) -> dict[str, Any]: ...

    def _fetch(self, ref: str) -> bytes:
        """A logged tool result's bytes (a replay re-tokenizes them)."""
        return bytes(self.store.get(ref, self.tenant))

    async def _blocks(self, refs: list[Any]) -> list[Any]:
        """The shared blocks `refs` name (read-only views of the object store), fetched with one ray.get on this
        tenant's lane. NOTE: awaiting each ref on the host's event loop (a future and callbacks per block) held
        that loop for 65-83 ms at a time while four forks of a 7k-token session adopted their blocks, and every
        other tenant's calls on the host waited: info 2.3 -> 40 ms at the median, create 6.8 -> 197 ms."""
        return list(await self._run(lambda: ray.get(list(refs))))

    def _prefix(self, tokens: list[int], blocks: list[Any], model_id: str | None = None) -> PrefixKV:
        """The adopted prefix: `blocks` (one per block) holding the first tokens of `tokens`, computed by a kernel of
        `model_id` (default: this host's, whose radix tree holds the blocks). The kernel refuses a prefix of another
        model_id. NOTE: blocks fetched from another node were wrapped with this kernel's own id, so that check could
        never fail, and another CPU code path's blocks were adopted though their bits differ."""
        n = len(blocks) * self.kernel.block_size
        return PrefixKV(tuple(tokens[:n]), self.kernel.block_size, tuple(blocks), model_id or self.kernel.model_id)

    async def restore(self, ops: list[Op] | None = None, prefix_refs: list[Any] | None = None,
                      tokens: list[int] | None = None, prefix_model_id: str | None = None) -> dict[str, Any]:
        """Regenerate from the op log (after the previous actor was lost); or, for a fork, write
        `ops` (the parent's log + a fork marker) as this session's log first, then replay it.

        A fork on the parent's node also gets `prefix_refs` (ObjectRefs of the parent's blocks,
        one per block of `tokens`, its tokens at the fork point): they are adopted copy-on-write
        and only the tokens past them are computed (`_replay`). A regeneration replays the
        whole log's ledger and computes the tokens the session holds at its end. `prefix_model_id`: the model_id
        of the kernel that exported `prefix_refs` on another node. Blocks that can no longer be fetched (their
        owner, the parent's host, died) are not adopted: the whole log is replayed instead."""
        prefix = await self._shared_prefix(tokens or [], prefix_refs, prefix_model_id) if prefix_refs else None
        async with self._lock:
            self._check_open()

            def work() -> None:
                # NOTE: on the lane, as `_write`: a restore still queued when `close` gave up waiting for it wrote an
                # orphan log (the fleet had deleted the session's) and took its blobs' references for good
                if self.closed:
                    raise SessionGone(f"session {self.session_id} was closed on this host: nothing restored")
                if ops is not None:  # NOTE: one write; op by op, each a store transaction, a fork of a long log
                    # held SQLite's writer lock against every tenant's writes (another's create: 8 -> 357 ms)
                    # the fork references its parent's tool results too (those references first, then the log)
                    write_fork_log(self.store, self.tenant, self.session_id, ops)
                log = parse_log(self.store.oplog_read(self.tenant, self.session_id))
                if not log:
                    raise NotFound(f"session {self.session_id}: no op log to regenerate from")
                ctx, adopted = self._replay(log, prefix)
                ctx.sink, ctx.store = self._write, self.store
                self.op_fps, self.history_tokens, self.last_op_index = own_op_fps(log), history_tokens(log), None
                # A quarantine logged without the eviction of its ref's tokens (an admission whose host failed or
                # died between the two writes) is finished before the session is served: logged, then applied.
                from fleet.core.quarantine.admit import finish_admissions

                finish_admissions(ctx)
                self.ctx, self.num_adopted_tokens, self.num_replayed_ops = ctx, adopted, len(log)
                self.num_prefilled_tokens += ctx.session.num_computed

            await self._run(work)
            if self.closed:  # NOTE: a close waits for this lock; a rebuild it overtook answers no row of a closed session
                raise SessionGone(f"session {self.session_id} was closed while it was rebuilt on this host")
            return self.info_row()

    async def _shared_prefix(self, tokens: list[int], refs: list[Any], model_id: str | None) -> PrefixKV | None:
        """The prefix a fork adopts from `refs`, or None when Ray lost them (ObjectLostError and its kinds).

        NOTE: a cross-node fork's blocks are owned by the parent's host; when it died after handing out their refs
        (share_prefix), the fetch raised OwnerDiedError and the fork failed with a raw RayTaskError (INTERNAL at
        the gRPC edge, and not retried) although the child's log alone rebuilds it."""
        try:
            return self._prefix(tokens, await self._blocks(refs), model_id)
        except ray.exceptions.ObjectLostError:
            return None

    def _replay(self, log: list[Op], prefix: PrefixKV | None) -> tuple[SessionContext, int]:
        """The context rebuilt from its log (nothing is written), and the tokens it adopted.

        The ledger is replayed first and the session computes the log's final tokens once
        (`SessionContext.replay_over`): what it holds now, not everything it ever held, so a
        session that appended and evicted 60 x 4,000 tokens and holds 45 computes 45. With
        `prefix` (a fork sharing its parent's blocks) it adopts them copy-on-write and computes
        only the tokens past them. A log whose KV is not a function of its tokens (a reposition
        eviction with survivors), or a prefix that does not match it, falls back to the op-by-op
        replay. Either way the cache is bit-identical to it.
        """
        session = self.kernel.session(prefix=prefix) if prefix is not None else self.kernel.session()
        try:
            ctx = SessionContext.replay_over(log, session, self.tokenizer, self._fetch, self.tenant, self.session_id)
            return ctx, prefix.num_tokens if prefix is not None else 0
        except FailedPrecondition:  # NOTE: a log the op-by-op replay refuses too (InvalidArgument) fails here, at once
            session.close()
        return SessionContext.replay(log, self.kernel, self.tokenizer, self._fetch, self.tenant, self.session_id), 0
