"""SessionKernel: one session's kernel state inside a kernel host (DESIGN §3, CONTRIBUTING §15).

A kernel host (workers/host.py: one Ray actor per node, one process, the model's weights loaded once)
holds many SessionKernels. Write path of every mutating call (write-ahead, the context's own contract):

    caller ──call(tenant, sid, "append_message", tokens, role, op_id)──▶ KernelHost ──▶ SessionKernel
        ──(the host's tenant lanes: a thread)──▶ ctx.add_message
                                                   1. validate        bad input: nothing logged, nothing changed
                                                   2. oplog_append    durable
                                                   3. apply to the KV cache
        ◀── reply (logits) ───────────────────────── acknowledged

The context's work runs on the host's thread pool, in the session's tenant's lane (workers/lanes.py), so
the host's event loop stays free to answer `info` / `ping` while a long prefill runs, and one tenant's work
never holds every thread. Ops of one session never interleave (its lock). A call's op ids, its write-ahead log
and a closed or torn session's guards are workers/session_ops.py's (SessionOps, with SessionGone and SessionTorn);
a rebuild from the log, and a fork's, workers/session_restore.py's (SessionRestore).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fleet.core.context import QUARANTINED, Piece, SessionContext
from fleet.core.errors import AlreadyExists, FailedPrecondition
from fleet.core.kernel import EvictReport, Kernel, PrefixKV
from fleet.core.oplog import (
    EvictOp,
    call_fingerprint,
    exact_tokens,
    kv_follows_tokens,
    last_index_of,
    num_tokens,
    parse_log,
)
from fleet.core.session_types import OpResult
from workers.packed import Packed, pack_ops
from workers.placement import delete_log
from workers.session_ops import Runner, SessionGone, SessionTorn
from workers.session_restore import SessionRestore

__all__ = ["SessionGone", "SessionKernel", "SessionTorn", "logged_eviction"]


class SessionKernel(SessionRestore):
    """One session on a kernel host: its context (KV cache, pieces, op log), lock and counters.

    Args:
        kernel, tokenizer, store: the host's own (shared by every session it holds).
        run: the host's lanes (`TenantLanes.run`): where this session's work runs.
        host: the host's actor name (listed with the session).
        owner: the try that opened it (workers/host.py): a failed try removes only the session it opened.
        create_op_id: the op id of the create or fork that made the session (its registry record's): a rebuild's
            kernel keeps it beside its own owner token, so a close of that session removes it and no other.
    """

    def __init__(self, tenant: str, session_id: str, kernel: Kernel, tokenizer: Any, store: Any, run: Runner, *,
                 node_id: str = "", epoch: int = 0, host: str = "", pid: int = 0, owner: str = "",
                 create_op_id: str = "") -> None:
        self.tenant, self.session_id, self.node_id, self.epoch = tenant, session_id, node_id, epoch
        self.host, self.pid = host, pid
        self.owner = owner  # the try that opened it (a create's or fork's op id, a rebuild's token): its cleanup's key
        self.create_op_id = create_op_id or owner  # the session's own (a close's key): a rebuild's owner is another
        self.kernel, self.tokenizer, self.store, self._lanes = kernel, tokenizer, store, run
        self.ctx: SessionContext | None = None   # None until the first piece (create) or a replay (restore)
        self.op_fps: dict[str, str] = {}         # op id -> its call's fingerprint, of this session's own log
        self.op_id = self.op_fp = ""             # the op id and fingerprint stamped on the ops of the call in progress
        self.last_op_index: int | None = None
        self.num_adopted_tokens = 0
        self._lock = asyncio.Lock()
        self._unstalled = asyncio.Event()
        self.closed = False
        self.created_at = self.last_active = time.time()
        self.num_replayed_ops = 0
        self.num_prefilled_tokens = 0  # tokens this actor computed (appends, exact evictions, replays); adopted blocks not counted
        self.history_tokens = 0  # what its log holds, as the controller's history quota charges it (oplog.history_tokens)
        self.in_flight = ""  # the verb running now (its state is the registry's: workers/registry.py)
        self.num_log_writes = 0  # ops handed to the op log (a write that raised may have landed all the same)
        self.torn = ""  # why the live state may differ from the log (a call failed after logging): not served

    async def close(self, timeout_s: float = 30.0) -> None:
        """Refuse every later op, and wait (at most `timeout_s`) for the one in flight to finish, so
        nothing writes the op log after the caller deletes it."""
        self.closed = True
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except TimeoutError:
            return
        self._lock.release()

    # -- verbs --------------------------------------------------------------------------------

    async def create(self, tokens: list[int], prefix_refs: list[Any] | None = None, op_id: str = "") -> OpResult:
        """First piece of a session: the system prompt's `tokens` (encoded once, by the fleet that
        placed it); adopts the shared blocks in `prefix_refs` (ObjectRefs, the first of `tokens`) if any."""
        prefix = self._prefix(tokens, await self._blocks(prefix_refs)) if prefix_refs else None  # zero-copy views
        return await self._mutate("create", op_id, lambda: self._create(tokens, prefix),
                                  call_fingerprint("create", tokens))

    def _create(self, tokens: list[int], prefix: PrefixKV | None) -> Piece:
        if self.ctx is not None:
            raise FailedPrecondition(f"session {self.session_id} already has a context")
        self._drop_earlier_try()
        ctx = SessionContext(self.kernel.session(prefix=prefix), self.tokenizer, self.tenant, self.session_id,
                             self._write, self.store)  # its first piece appends only what the prefix lacks
        ctx.op_id, ctx.op_fp = self.op_id, self.op_fp
        piece = ctx.add_system_tokens(tokens)
        self.ctx, self.num_adopted_tokens = ctx, len(prefix.tokens) if prefix is not None else 0
        return piece

    def _drop_earlier_try(self) -> None:
        """Before a create logs its system op: a log this session already has is an earlier try of
        the same create when its first op carries this create's op id (its host died after logging
        it, before answering, and the fleet tried again); it is dropped, so the prompt is logged
        once, not twice (a regeneration of a doubled log holds the prompt twice). The session was
        never acknowledged, so nothing else wrote it. Any other log is another session's: AlreadyExists."""
        log = parse_log(self.store.oplog_read(self.tenant, self.session_id))
        if not log:
            return
        if not self.op_id or log[0].op_id != self.op_id or (log[0].op_fp and log[0].op_fp != self.op_fp):
            raise AlreadyExists(f"session {self.session_id} already has an op log")
        delete_log(self.store, self.tenant, self.session_id, log)

    async def append_message(self, tokens: list[int], role: str, op_id: str = "") -> OpResult:
        """A chat message, encoded once by the caller (`encode_message`): never encoded again here."""
        return await self._mutate("append", op_id, lambda: self.context.add_message_tokens(role, tokens),
                                  call_fingerprint("append_message", tokens, role))

    async def append_output(self, tokens: list[int], op_id: str = "") -> OpResult:
        """Model output (token ids)."""
        return await self._mutate("append", op_id, lambda: self.context.add_output(list(tokens)),
                                  call_fingerprint("append_output", tokens))

    async def generate(self, n: int, op_id: str = "") -> OpResult:
        return await self._mutate("generate", op_id, lambda: self.context.generate(n), call_fingerprint("generate", n))

    async def evict(self, piece_id: int, mode: str = "exact", op_id: str = "") -> OpResult:
        return await self._mutate("evict", op_id, lambda: self.context.evict_piece(piece_id, mode),
                                  call_fingerprint("evict", piece_id, mode),
                                  logged=lambda: logged_eviction(self.context.ops, op_id))

    async def add_tool_result(self, ref: str, op_id: str = "") -> OpResult:
        """Append a stored tool result by ref (refused if quarantined)."""
        return await self._mutate("add_tool_result", op_id, lambda: self.context.add_tool_result(
            ref, self.store.get(ref, self.tenant)), call_fingerprint("add_tool_result", ref))

    async def admit_tool_result(self, ref: str, verdict: Any = None, op_id: str = "") -> OpResult:
        """Act on a verdict on a stored tool result (`verdict`: a fleet.core.quarantine Verdict the caller reached,
        the controller's Judge; None: run the default detector here); a quarantine evicts its tokens with a
        proof."""
        from fleet.core.quarantine.admit import admit_tool_result, logged_admission

        return await self._mutate("admit_tool_result", op_id, lambda: admit_tool_result(
            self.context, ref, self.store, self.tenant, verdict=verdict), call_fingerprint("admit_tool_result", ref),
            logged=lambda: logged_admission(self.context, ref, op_id))

    # -- reads --------------------------------------------------------------------------------

    async def working_set(self, budget_tokens: int) -> Packed:
        """The working set (fleet.core.working_set), packed on the lane (workers/packed.py): it has an item per
        piece, evicted ones included, and Ray pickled it on the host's event loop (0.7 s for 100,000 pieces)."""
        from fleet.core.working_set import working_set

        async with self._served():
            packed: Packed = await self._run(lambda: Packed.of(working_set(self.context, budget_tokens, store=self.store)))
            return packed

    async def fork_point(self) -> dict[str, Any]:
        """The op log (`ops`: packed, workers/packed.py) and the tokens at one instant (a fork's starting point),
        read together. NOTE: the log is packed on the lane: returned as a list, Ray pickled it on the host's event
        loop (1.2 s for 200,000 ops), and every other tenant's call on the host waited."""
        async with self._served():
            ops, tokens = list(self.context.ops), list(self._s.tokens)
        return {"ops": await self._run(lambda: pack_ops(ops)), "tokens": tokens}

    async def export_prefix(self, num_tokens: int) -> PrefixKV:
        """The session's first `num_tokens` tokens and their KV blocks, for its host's radix tree (shared with
        other sessions and forks, which adopt them as what those tokens compute).

        Raises:
            FailedPrecondition: the session's KV no longer follows its tokens (`kv_follows_tokens`: a reposition
                eviction re-rotated its survivors), so its blocks are not what a prefill of their tokens
                computes. NOTE: checked here, under the session's lock, on the ops the blocks come from: a check
                on ops read earlier (a fork point) let an eviction that ran meanwhile publish re-rotated blocks,
                which later sessions of the tenant adopted (max|d logits| 0.08-0.1 against their own prefill).
        """
        async with self._served():  # never while an op is writing the cache on the session thread
            if not kv_follows_tokens(self.context.ops):
                raise FailedPrecondition(f"session {self.session_id}: its KV no longer follows its tokens (a "
                                         "reposition eviction re-rotated it): its blocks are not shared")
            prefix: PrefixKV = await self._run(lambda: self._s.export_prefix(num_tokens))  # on the lane, not the loop
            return prefix

    # Reads take the session's lock: they see the state between two ops, never one half-applied on a
    # lane thread. The digest hashes the whole cache, so it runs on a lane thread too (the host's event
    # loop serves every session it holds).

    async def digest(self) -> str:
        async with self._served():
            return str(await self._run(self._s.digest))

    async def snapshot(self, include_tokens: bool = False) -> dict[str, Any]:
        """The session's row (`info_row`), digest and, if asked, tokens, read in one hold of its lock: of one state.
        NOTE: GetSession read them in three calls (the row without the lock), so an op between them answered the
        row of one state and the digest or tokens of another (35 tokens in the row, 69 token ids)."""
        async with self._served():
            digest = str(await self._run(self._s.digest))
            return {"info": self.info_row(), "digest": digest, "tokens": list(self._s.tokens) if include_tokens else []}

    async def last_logits(self) -> Any:
        async with self._served():
            return self._s.last_logits

    async def tokens(self) -> list[int]:
        async with self._served():
            return list(self._s.tokens)

    async def pieces(self) -> Packed:
        """Every piece, evicted ones included, packed on the lane (as `working_set`)."""
        async with self._served():
            pieces = list(self.context.pieces)
        packed: Packed = await self._run(lambda: Packed.of(pieces))
        return packed

    async def stall(self, seconds: float) -> None:
        """Fault injection (tests and chaos drills; reachable through Ray only, not the API): hold the
        session's lock for `seconds` (at most 600) or until `unstall`, as a kernel stuck in a long
        prefill would. Every op and read of this session waits meanwhile; other sessions do not."""
        self._unstalled.clear()
        async with self._lock:
            try:
                await asyncio.wait_for(self._unstalled.wait(), min(float(seconds), 600.0))
            except TimeoutError:
                pass

    async def unstall(self) -> None:
        self._unstalled.set()

    async def info(self) -> dict[str, Any]:
        self._check_served()  # the fleet's check that the host holds the session whole (KernelFleet._holds)
        return self.info_row()

    async def ping(self) -> str:
        return "ok"

    def info_row(self) -> dict[str, Any]:
        ctx = self.ctx
        s = ctx.session if ctx is not None else None
        mem = s.memory() if s is not None else None
        return {
            "session": self.session_id, "tenant": self.tenant, "node": self.node_id,
            "actor": self.host, "host": self.host, "tokens": len(s) if s is not None else 0,
            "bytes_alone": mem.bytes_alone if mem else 0, "bytes_shared": mem.bytes_shared if mem else 0,
            "adopted_tokens": self.num_adopted_tokens, "num_ops": len(ctx.ops) if ctx else 0,
            "pieces": len(ctx.pieces) if ctx else 0, "replayed_ops": self.num_replayed_ops,
            "prefilled_tokens": self.num_prefilled_tokens, "history_tokens": self.history_tokens,
            "quarantined_spans": sum(p.state == QUARANTINED for p in ctx.pieces) if ctx else 0,
            "in_flight": self.in_flight, "epoch": self.epoch,
            "last_active": self.last_active, "pid": self.pid,
            "backend": self.kernel.backend, "device": str(self.kernel.device), "model_id": str(self.kernel.model_id),
        }

    def memory(self) -> tuple[int, int]:
        """(bytes alone, bytes shared) of the session's KV blocks; (0, 0) before its first piece."""
        if self.ctx is None:
            return 0, 0
        mem = self.ctx.session.memory()
        return mem.bytes_alone, mem.bytes_shared



def logged_eviction(ops: list[Any], op_id: str) -> EvictReport | None:
    """The report of an eviction retried under `op_id`, read from the log (nothing is applied again): its span,
    and what it recomputed or re-rotated, derived from the session's length before it. A reposition's measured
    invariant is not logged: such a report says None for it and claims no exactness.

    NOTE: a retried evict was answered with no report at all (its host died after logging it, and the fleet
    retried under the same op id), and the gRPC answer failed with INTERNAL on it.
    """
    i = last_index_of(ops, op_id)
    op = ops[i] if i is not None else None
    if i is None or not isinstance(op, EvictOp):
        return None
    end = op.start + op.length
    survivors = max(0, num_tokens(ops[:i]) - end)
    if survivors == 0 or op.mode == "exact":  # exact unless the tokens before its span carry an earlier reposition's
        exact = exact_tokens(ops[: i + 1]) == num_tokens(ops[: i + 1])
        return EvictReport(op.mode, op.start, op.length, survivors == 0, op.length, survivors, 0, exact, None,
                           op.start + survivors > 0)  # (an emptied session has no logits: Session.evict)
    return EvictReport(op.mode, op.start, op.length, False, op.length, 0, survivors, False, None, False)
