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
never holds every thread. Ops of one session never interleave (its lock). Every op carries the caller's op
id and its fingerprint (oplog.call_fingerprint); a retried op already in the log (written just before a crash,
then replayed) is answered from the current state, not applied twice, and a different call under a logged op id
is refused (AlreadyExists), not answered as its retry. A closed session refuses every op that was waiting for its
lock, and an op already past it logs nothing (its write refuses: `close` waits 30 s at most). A call that fails after it handed an op to the log (a recompute that raised mid-evict) may leave the live
state torn while the log holds the op: that state is never served again (every later call raises SessionGone,
so the fleet rebuilds the session from its log, which applies the op) and the call raises SessionTorn
(UNAVAILABLE: retry with the same op_id, answered replayed once rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import ray

from fleet.core.context import QUARANTINED, Piece, SessionContext
from fleet.core.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from fleet.core.kernel import EvictReport, Kernel, PrefixKV, Session
from fleet.core.oplog import (
    AppendOp,
    EvictOp,
    Op,
    call_fingerprint,
    check_op_reuse,
    exact_tokens,
    history_charge,
    history_tokens,
    kv_follows_tokens,
    last_index_of,
    num_tokens,
    own_op_fps,
    parse_log,
    to_dict,
)
from fleet.core.session_types import OpResult
from workers.packed import Packed, pack_ops
from workers.placement import add_blob_refs, delete_log, undo_blob_ref, write_fork_log

Runner = Callable[[str, Callable[[], Any]], Awaitable[Any]]  # (tenant, fn) -> fn's result, on a lane thread


class SessionGone(NotFound):
    """The session is not held by this host (it was closed, released, or the host restarted empty)."""


class SessionTorn(Unavailable):
    """A call failed after its op was logged: the session's live state may lack what its log holds. The
    state is not served again; a retry with the same op id is answered from the log once rebuilt."""


class SessionKernel:
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

    def _write(self, op: Op) -> None:
        """Write-ahead (the context's sink): log the op, stamped with the call's op id, before it is
        applied and acknowledged; a logged tool result references its blob, so the store's GC never
        collects it while a session holds it.

        The reference is taken first: a blob the leader's GC collected meanwhile (its lease ran
        out after the actor read it) refuses the op with nothing logged, instead of a log entry
        no replay could ever fetch; an op log write that fails gives the reference back, unless the op
        landed all the same (`undo_blob_ref`).

        A closed session refuses the op (SessionGone) with nothing logged and no reference taken.
        NOTE: `close` stops waiting for the op in flight after its timeout and the fleet then deletes
        the log; an op still queued for a lane thread ran after that, wrote a log of its own (nobody's:
        the session was gone) and held its blob's reference forever, and its caller got an ack. Only an
        op whose store write was already under way when close gave up can still land after it."""
        if self.closed:
            raise SessionGone(f"session {self.session_id} was closed on this host: its op was not logged")
        add_blob_refs(self.store, self.tenant, self.session_id, [op])
        self.num_log_writes += 1  # NOTE: before the write: one that raises may still be durable
        try:
            self.last_op_index = int(self.store.oplog_append(self.tenant, self.session_id, to_dict(op)))
        except BaseException:
            undo_blob_ref(self.store, self.tenant, self.session_id, op)
            raise
        if op.op_id:
            self.op_fps[op.op_id] = op.op_fp
        if isinstance(op, AppendOp):
            self.history_tokens += history_charge(op.length)

    def _fetch(self, ref: str) -> bytes:
        """A logged tool result's bytes (a replay re-tokenizes them)."""
        return bytes(self.store.get(ref, self.tenant))

    @property
    def context(self) -> SessionContext:
        if self.ctx is None:
            raise FailedPrecondition(f"session {self.session_id} has no state yet")
        return self.ctx

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await self._lanes(self.tenant, fn)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionGone(f"session {self.session_id} was closed on this host")
        self._check_served()

    def _check_served(self) -> None:
        """SessionGone for a torn session: the fleet rebuilds it from its op log, then calls again."""
        if self.torn:
            raise SessionGone(f"session {self.session_id}: {self.torn}; its state is rebuilt from its op log")

    @contextlib.asynccontextmanager
    async def _served(self) -> AsyncIterator[None]:
        """A read's hold of the session's lock, on a state that may be served (never a torn one)."""
        async with self._lock:
            self._check_served()
            yield

    def _tear(self, verb: str, op_id: str, e: BaseException) -> SessionTorn:
        """Mark the state torn (never served again) after `verb` failed with `e` past its log write."""
        self.torn = f"{verb} (op_id {op_id!r}) failed after its op was logged ({e!r})"
        return SessionTorn(f"session {self.session_id}: {self.torn}; the session is rebuilt from its op log, "
                           "which applies the op: retry with the same op_id (answered replayed)")

    async def close(self, timeout_s: float = 30.0) -> None:
        """Refuse every later op, and wait (at most `timeout_s`) for the one in flight to finish, so
        nothing writes the op log after the caller deletes it."""
        self.closed = True
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except TimeoutError:
            return
        self._lock.release()

    async def _mutate(self, verb: str, op_id: str, fn: Callable[[], Any], op_fp: str = "",
                      logged: Callable[[], Any] | None = None) -> OpResult:
        """Run one mutating call: idempotent on `op_id` (a different call under a logged one, by its
        fingerprint `op_fp`, is refused), serialised, off the event loop. `logged`: the verb's own answer
        to its retry, read from the log (default: the piece an append added)."""
        async with self._lock:
            self._check_open()
            if op_id and op_id in self.op_fps:
                check_op_reuse(op_id, self.op_fps[op_id], op_fp)  # AlreadyExists: nothing applied
                # NOTE: on the lane: its look-up walks the log (50 ms for 200,000 ops), on the host's event loop
                # every other tenant's call on the host waited for each retry
                replayed: OpResult = await self._run(lambda: self._replayed(op_id, logged))
                return replayed
            self.op_id, self.op_fp, self.in_flight = op_id, op_fp, verb
            if self.ctx is not None:
                self.ctx.op_id, self.ctx.op_fp = op_id, op_fp  # stamped on every op this call writes
            before = self.ctx.session.num_computed if self.ctx is not None else 0  # a create: adopted blocks are free
            writes = self.num_log_writes
            try:
                result = await self._run(fn)
            except Exception as e:
                # NOTE: a create's torn log is not served either way: the host drops the session, the fleet its log
                if self.ctx is not None and verb != "create" and self.num_log_writes != writes:
                    raise self._tear(verb, op_id, e) from e
                raise  # nothing logged: nothing changed (validation refused it before the log)
            finally:
                self.op_id, self.op_fp, self.in_flight = "", "", ""
                if self.ctx is not None:
                    self.ctx.op_id = self.ctx.op_fp = ""
            self.num_prefilled_tokens += self._s.num_computed - before
            self.last_active = time.time()
            # NOTE: None when the call logged nothing (a clean verdict): it answered the previous call's index, and
            # None once the session was rebuilt (last_op_index is not kept), so the same call answered two ways
            return self._reply(result, self.last_op_index if self.num_log_writes != writes else None)

    def _reply(self, result: Any, op_index: int | None, replayed: bool = False) -> OpResult:
        s = self._s
        return OpResult(result, s.last_logits, len(s), op_index, replayed, self.history_tokens)

    def _replayed(self, op_id: str, logged: Callable[[], Any] | None = None) -> OpResult:
        """The answer to a retried op already in the log: `logged()`, or the piece its append added (None
        for other verbs), and its index in the log; nothing is applied again."""
        ops = self.context.ops
        index = last_index_of(ops, op_id)
        op = ops[index] if index is not None else None
        pieces = self.context.pieces
        piece = pieces[op.piece] if isinstance(op, AppendOp) and op.piece < len(pieces) else None
        return self._reply(logged() if logged is not None else piece, index, replayed=True)

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

    @property
    def _s(self) -> Session:
        return self.context.session


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
        return EvictReport(op.mode, op.start, op.length, survivors == 0, op.length, survivors, 0, exact, None, True)
    return EvictReport(op.mode, op.start, op.length, False, op.length, 0, survivors, False, None, False)
