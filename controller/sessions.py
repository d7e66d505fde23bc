"""Sessions: the controller's session service over the Ray fleet of session kernels (workers.fleet.KernelFleet).

The gRPC SessionServicer translates proto <-> domain and calls this; everything else lives here: the fleet
(built on first use: it joins the Ray cluster `ray.init` already started in this process, or starts a local
one), the tenants' quotas and call lanes (controller/quotas.py; the token ledger: controller/session_quota.py), the
calls in flight and the idle reaper (controller/session_reaper.py). How one call runs (its tenant's lane, its session
in use, its tokens reserved and settled in the quota) is controller/session_calls.py's SessionCalls, a mixin on
Sessions' one state.

    RPC ──▶ SessionServicer (validate) ──▶ Sessions.append_text(tenant, sid, role, text): encoded once
              quota: reserve ▶ tenant's lane thread ▶ KernelFleet.append_message ▶ actor (token ids, no re-encode)
              ◀ OpResult (piece, num_tokens, logits) ── the ledger is set to the session's count

Invariants: a call reserves its tenant's quota (and a create its session's name) before it runs and releases
it when it ends, so nothing that passes a quota is ever logged or spawned; every fleet call of a tenant runs
on that tenant's lane (`TenantLanes`); a session is released by the reaper only with no call of it in flight,
and a call arriving during its release waits for it. The kernel spec lives in the store
(`controller/kernel_spec`), so a restarted controller regenerates every session with the same model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from controller.kernel_placement import kernel_spec_of
from controller.quotas import TenantLanes
from controller.ray_address import check_ray, on_daemon_thread
from controller.session_calls import SessionCalls
from controller.session_quota import SessionQuota
from controller.session_reaper import SessionActivity, reap_loop
from fleet.core.errors import InvalidArgument, NotFound
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.quarantine.detector import Verdict
from fleet.core.session_types import OpResult, SessionRow, check_token_ids

log = logging.getLogger("kvfleet.controller")
T = TypeVar("T")
MAX_GENERATE = 256
DRAIN_S = 10.0  # how long a stop waits for the session calls running (Sessions.close)


class Sessions(SessionCalls):
    """Agent sessions of every tenant, on one KernelFleet (built on first use)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx  # the controller's ServiceContext: store, Ray address, limits, stop hooks
        self.fleet: Any = None
        self._init = asyncio.Lock()
        self._admin = ThreadPoolExecutor(2, thread_name_prefix="kvfleet-sessions-admin")  # build, seed, reap
        self._lanes = TenantLanes(1)  # its width is set from the limits when the fleet is built
        self.quota = SessionQuota(self.get_fleet, self._run)  # the token ledger (controller/session_quota.py)
        self._creating: set[tuple[str, str]] = set()
        self._activity = SessionActivity()  # calls in flight, last touches, releases (controller/session_reaper.py)
        self._reaper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- session verbs ----------------------------------------------------------------------------

    async def create(self, tenant: str, sid: str, system_prompt: str) -> SessionRow:
        """Place and start session `sid`; its system prompt is encoded once, here (counted, placed, appended)."""
        if not system_prompt:
            raise InvalidArgument("the system prompt must be a non-empty str")
        fleet = await self.get_fleet()
        tokens = await self._run(tenant, encode_message, fleet.tokenizer, "system", system_prompt)
        _within_context(len(tokens), fleet.kernel.config.max_context, "tokens of the system prompt are",
                        "no session was created")  # NOTE: before, it was placed, and refused as no node having room
        # for it ("raise --node-kv-bytes"): the wrong fix
        rec = await self._new_session(tenant, sid, len(tokens), sid, fleet.create_session, tenant, sid,
                                      system_prompt, tokens)
        return await self.row(tenant, rec)

    async def append_text(self, tenant: str, sid: str, role: str, text: str, op_id: str) -> OpResult:
        """Append a chat message. Its text is encoded once, here (on the tenant's lane: a long text is no other
        tenant's wait); the same tokens are counted against the quota and appended, never encoded again."""
        fleet = await self.get_fleet()
        tokens = await self._run(tenant, encode_message, fleet.tokenizer, role, text)
        if not tokens:  # NOTE: the kernel refused it, naming token ids the caller never sent ("a piece needs >= 1 token id")
            raise InvalidArgument(f"the message's text {text[:64]!r} encodes to no tokens; send at least one character "
                                  "of text; nothing was appended")
        _within_context(len(tokens), fleet.kernel.config.max_context, "tokens of the message are")  # before the quota: NOTE:
        # a message over the context was refused as over the KV quota, which named the wrong fix
        return await self._mutate(tenant, sid, len(tokens), op_id, fleet.append_message, tokens, role, op_id)

    async def append_output(self, tenant: str, sid: str, token_ids: Sequence[int], op_id: str) -> OpResult:
        """Append model output; the ids are checked here, the edge (once), on the tenant's lane.

        NOTE: more ids than the session's context can hold are refused before any is read: before, up to 4M ids
        (a 4 MiB message) were converted and checked on the event loop, 0.8 s each, before the quota refused them.
        """
        fleet = await self.get_fleet()
        cfg = fleet.kernel.config
        _within_context(len(token_ids), cfg.max_context, "token ids in one append are")
        ids = await self._run(tenant, check_token_ids, token_ids, cfg.vocab_size)
        return await self._mutate(tenant, sid, len(ids), op_id, fleet.append_output, ids, op_id)

    async def add_tool_result(self, tenant: str, sid: str, ref: str, op_id: str) -> OpResult:
        fleet = await self.get_fleet()
        n = await self._run(tenant, self.quota.blob_tokens, tenant, ref)
        return await self._mutate(tenant, sid, n, op_id, fleet.add_tool_result, ref, op_id)

    async def generate(self, tenant: str, sid: str, n: int, op_id: str) -> OpResult:
        if not 1 <= n <= MAX_GENERATE:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_GENERATE}, got {n}")
        fleet = await self.get_fleet()
        return await self._mutate(tenant, sid, n, op_id, fleet.generate, n, op_id)

    async def evict(self, tenant: str, sid: str, piece_id: int, mode: str) -> OpResult:
        if mode not in ("exact", "reposition"):
            raise InvalidArgument(f"evict mode must be 'exact' or 'reposition', got {mode!r}")
        fleet = await self.get_fleet()
        r: OpResult = await self._call(tenant, sid, fleet.evict, tenant, sid, piece_id, mode)
        self.quota.set_tokens(tenant, sid, r.num_tokens, r.history_tokens)  # exact, like an append's
        return r

    async def fork(self, tenant: str, sid: str, child: str) -> SessionRow:
        fleet = await self.get_fleet()
        ledger = await self.quota.counted(tenant)
        n, history = ledger.num_tokens(tenant, sid), ledger.num_history(tenant, sid)  # its log copies the parent's
        rec = await self._new_session(tenant, child, n, sid, fleet.fork, tenant, sid, child, history=history)
        return await self.row(tenant, rec)  # the child's own count: its log may hold an append the parent's lacked

    async def admit_tool_result(self, tenant: str, sid: str, ref: str,
                                judge: Callable[[str, str], Awaitable[Verdict]]) -> OpResult:
        """Act on `judge(ref, tenant)`'s verdict (the controller's Judge, in the tenant's judge lane): the
        kernel host only acts on it, so no kernel host loads a detector. An unknown session costs no
        inspection."""
        fleet = await self.get_fleet()
        await self._call(tenant, sid, fleet.check_session, tenant, sid)
        verdict = await judge(ref, tenant)
        r: OpResult = await self._call(tenant, sid, fleet.admit_tool_result, tenant, sid, ref, verdict)
        self.quota.set_tokens(tenant, sid, r.num_tokens, r.history_tokens)  # a quarantine evicts: exact, like an append's
        return r

    async def working_set(self, tenant: str, sid: str, budget_tokens: int) -> Any:
        fleet = await self.get_fleet()
        return await self._call(tenant, sid, fleet.working_set, tenant, sid, budget_tokens)

    async def get(self, tenant: str, sid: str, include_tokens: bool) -> tuple[SessionRow, str, list[int]]:
        """The session's row, its cache digest and (if asked) its tokens, all of one state (`KernelFleet.snapshot`)."""
        fleet = await self.get_fleet()
        snap = await self._call(tenant, sid, fleet.snapshot, tenant, sid, include_tokens)
        return self._counted(tenant, {"session": sid}, snap["info"]), str(snap["digest"]), list(snap["tokens"])

    async def close_session(self, tenant: str, sid: str) -> None:
        fleet = await self.get_fleet()
        try:
            await self._call(tenant, sid, fleet.close, tenant, sid)
        except NotFound:  # not there: it holds nothing either
            self._forget(tenant, sid)
            raise
        self._forget(tenant, sid)

    async def list_sessions(self, caller: str, tenant: str | None, live: bool,
                            with_nodes: bool) -> tuple[list[SessionRow], list[dict[str, Any]]]:
        """Rows of `tenant`'s sessions (None: every tenant's), and the nodes' rows if asked, on `caller`'s lane."""
        fleet = await self.get_fleet()
        rows = await self._run(caller, fleet.list_sessions, live, tenant)
        nodes = await self._run(caller, fleet.node_stats) if with_nodes else []
        return [self.quota.with_history(SessionRow.from_row(r)) for r in rows], list(nodes)

    async def row(self, tenant: str, rec: dict[str, Any]) -> SessionRow:
        """The session's row: its registry record `rec` and its actor's info (whose epoch is the
        registry's: one counter, kept by KernelFleet)."""
        fleet, sid = await self.get_fleet(), str(rec["session"])
        return self._counted(tenant, rec, await self._call(tenant, sid, fleet.info, tenant, sid))

    def _counted(self, tenant: str, rec: dict[str, Any], info: dict[str, Any]) -> SessionRow:
        """The row of `rec` under its actor's `info`, its tokens counted in the tenant's quota."""
        row = SessionRow.from_row({**rec, **info})
        self.quota.set_tokens(tenant, row.session_id, row.num_tokens, int(info.get("history_tokens", -1)))
        return row

    # -- the fleet, its lanes and the ledger ------------------------------------------------------

    async def get_fleet(self) -> Any:
        """The KernelFleet, built (with the ledger, the lanes' width and the reaper) on first use."""
        if self.fleet is None:
            async with self._init:
                if self.fleet is None:
                    fleet = await on_daemon_thread(self._build)
                    self.quota.open(fleet)
                    self._lanes.width = self.limits.tenant_concurrency
                    self._loop = asyncio.get_running_loop()
                    self._reaper = asyncio.create_task(reap_loop(lambda: self.limits, self._lanes.prune,
                                                                 self.reap_idle))
                    self.fleet = fleet
        return self.fleet

    def _build(self) -> Any:
        import ray

        from workers.fleet import KernelFleet
        from workers.placement import RAY_NAMESPACE

        if self.ctx.ray_address:
            check_ray(self.ctx.ray_address)
        if self.ctx.ray_address and not ray.is_initialized():
            ray.init(address=self.ctx.ray_address, namespace=RAY_NAMESPACE, log_to_driver=False)
        elif not ray.is_initialized():  # a local Ray: `kvfleet controller` owns its process tree (controller/ray_local.py)
            from controller import ray_local

            ray_local.start(lambda: ray.init(namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False))
        # On a cluster (--ray-address) the fleet is detached: a restarted or newly elected controller
        # reattaches to its kernel hosts and sessions (no re-prefill); a local Ray dies with us anyway.
        detached = bool(self.ctx.ray_address)
        self.ctx.kernel_spec = kernel_spec_of(self.ctx.store)  # written back if the store loses it (Controller)
        fleet = KernelFleet(self.ctx.store_url, self.ctx.kernel_spec, detached=detached,
                            node_kv_bytes=self.ctx.node_kv_bytes, node_max_sessions=self.ctx.node_max_sessions)
        self.ctx.kernel_fleet = fleet  # the fleet metrics poller reads it (controller/fleet_metrics.py)
        self.ctx.on_stop.append(self.close)         # the reaper first, then the fleet
        self.ctx.on_stop.append(fleet.release if detached else fleet.shutdown)
        return fleet

    async def _run_admin(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._admin, functools.partial(fn, *args))

    # -- idle reaping -----------------------------------------------------------------------------

    async def reap_idle(self, ttl_s: float, now: float | None = None,
                        rows: list[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
        """Release the actor of every live session that no call touched for `ttl_s` seconds (none
        in flight); their records and op logs stay, so each regenerates on its next call.
        `rows`: the fleet's session rows (default: listed now). Returns the (tenant, session)
        pairs released."""
        now = time.time() if now is None else now
        listed: list[dict[str, Any]] = rows if rows is not None else await self._run_admin(self.fleet.list_sessions, True)
        release = functools.partial(self._run_admin, self.fleet.release_session)
        return await self._activity.reap_idle(listed, ttl_s, now, self._creating, release)

    def close(self) -> None:
        """Stop the reaper and the lanes (run by Controller.stop, from any thread): queued calls are dropped,
        and the running ones get up to DRAIN_S to end before this returns.

        NOTE: the fleet (the next stop hook) and then Ray were shut down under calls still running on the lanes'
        threads (their RPCs were cancelled, their threads were not): `kvfleet demo` stopped mid-run then died
        in Ray's core worker ("already been shutdown ... will exit", exit 1, its temporary directory left), or
        waited ~30 s at exit for those threads."""
        if self._reaper is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._loop.call_soon_threadsafe(self._reaper.cancel)
        pools = [*self._lanes.shutdown(), self._admin]
        self._admin.shutdown(wait=False, cancel_futures=True)
        drain = threading.Thread(target=_join, args=(pools,), daemon=True)
        drain.start()
        drain.join(DRAIN_S)
        if drain.is_alive():
            log.warning("sessions: calls still running %.0f s after the stop; stopping the fleet under them", DRAIN_S)


def _join(pools: Sequence[ThreadPoolExecutor]) -> None:
    for pool in pools:
        pool.shutdown(wait=True)


def _within_context(n: int, max_context: int, what: str, outcome: str = "nothing was appended") -> None:
    if n > max_context:
        raise InvalidArgument(f"{n} {what} over the session's context of {max_context} tokens "
                              f"(max_seq_len / sliding_window); {outcome}")
