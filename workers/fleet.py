"""KernelFleet: the small Python API over the Ray fleet of session kernels (wrapped in gRPC later).

    fleet = KernelFleet("sqlite:///kvfleet.db", {"kind": "synthetic"})
    fleet.create_session("acme", "s1", "You are a helpful agent.")
    r = fleet.append("acme", "s1", "hello")          # r.logits, r.num_tokens
    fleet.list_sessions(fleet=True)                   # one row per session, across nodes

A session lives in its node's kernel host (workers/host.py: one Ray actor, one process per node, many
sessions). Calls go to that host, which runs them on the session's SessionKernel. A session the host
no longer holds (the host died and Ray restarted it empty, or its node is gone) is marked lost
(witness kv="forgotten", epoch + 1) and regenerated from its op log, then the call is retried once
with the same op id (so an op that was logged just before the crash is not applied twice). A session whose
call failed after logging its op answers SessionGone too (workers/session_ops.py SessionTorn): it is
rebuilt from its log the same way. Every wait has a timeout: a fault never hangs a caller.

Calls that change what stands behind a name (create, fork, close, release, rebuild) may overlap: threads of
one fleet take the name's lock (workers/name_locks.py), so a create that loses to another gets AlreadyExists
and a close waits for a rebuild. Writers in other processes (two controllers during a leader change) are
kept apart by the registry's compare-and-set and the host's check-and-insert: a try that fails removes only
what it made (the kernel, op log and record of its own op id), never the session that won the name. A try whose
host call timed out may still be run by its host after that cleanup: the kernel it leaves, which no record names,
is replaced by the next create or fork of the name on that host, which the record names (KernelHost._insert).

Nodes come and go: the hosts follow Ray's node table (re-read at most every `node_refresh_s`, and
at once after a failure). A node that joins and has the resources sessions need gets a host and
takes new sessions; a node that dies is dropped, and its sessions are regenerated on a survivor on
their next call (or by `reconcile()`). Placement skips nodes whose KV or session budget is spent;
when none has room, ResourceExhausted.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import ray

from fleet.core.errors import InvalidArgument, NotFound
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.roles import check_role
from fleet.core.session_types import OpResult, check_token_ids
from workers.fleet_create import FleetCreate
from workers.host_cache import check_evict_start
from workers.nodes import NodeGone
from workers.placement import node_of
from workers.registry import LOST, SessionRecord, Stored
from workers.session_kernel import SessionKernel

__all__ = ["KernelFleet", "NodeGone", "OpResult"]


class KernelFleet(FleetCreate):
    """Sessions in kernel hosts (one Ray actor per node), state durable in the store. Its parts, claims and cleanup
    are workers/fleet_base.py's, its calls and rebuilds workers/fleet_rebuild.py's, its create and fork
    workers/fleet_create.py's."""

    def _tokens(self, x: str | bytes | list[int]) -> list[int]:
        """Text encoded, or token ids checked (the one rule: check_token_ids); the Python API's edge."""
        if isinstance(x, str | bytes):
            return self.tokenizer.encode(x)
        return check_token_ids(x, self.kernel.config.vocab_size) if len(x) else []

    # -- session verbs (create and fork: workers/fleet_create.py) ------------------------------

    # Mutating verbs: each runs under `op_id` (the caller's idempotency key; a fresh one if empty), and an
    # op id already in the session's log is answered (replayed=True), not applied again. Each returns the
    # SessionKernel's OpResult: its `result` (a Piece, an EvictReport, a ToolAdmission), the session's token count
    # and last logits.

    def append(self, tenant: str, session_id: str, content: str | list[int], role: str = "user",
               op_id: str = "") -> OpResult:
        """Append a message (text, with its role; encoded here, the Python API's edge) or model output
        (token ids); result: the Piece."""
        if isinstance(content, list):
            return self.append_output(tenant, session_id, self._tokens(content), op_id)
        if not isinstance(content, str):
            raise InvalidArgument(f"append takes text or token ids, got {type(content).__name__}")
        check_role(role)  # before the template renders it
        return self.append_message(tenant, session_id, encode_message(self.tokenizer, role, content), role, op_id)

    def append_message(self, tenant: str, session_id: str, tokens: list[int], role: str,
                       op_id: str = "") -> OpResult:
        """Append a chat message already encoded (`encode_message(self.tokenizer, role, text)`) by a caller
        that counted its tokens: it is never encoded again."""
        key = op_id or uuid.uuid4().hex
        check_role(role)  # before anything is logged
        return self._call(tenant, session_id, SessionKernel.append_message, tokens, role, key)  # type: ignore[no-any-return]

    def append_output(self, tenant: str, session_id: str, tokens: list[int], op_id: str = "") -> OpResult:
        """Append model output: token ids the caller checked (`check_token_ids`)."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.append_output, tokens, key)  # type: ignore[no-any-return]

    def generate(self, tenant: str, session_id: str, n: int, op_id: str = "") -> OpResult:
        """Greedy-decode `n` tokens and append them as an output piece (`result.tokens`)."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.generate, n, key)  # type: ignore[no-any-return]

    def evict(self, tenant: str, session_id: str, piece_id: int, mode: str = "exact", op_id: str = "") -> OpResult:
        """Evict one piece from the session's KV cache; `result`: the kernel's EvictReport."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.evict, piece_id, mode, key)  # type: ignore[no-any-return]

    def add_tool_result(self, tenant: str, session_id: str, ref: str, op_id: str = "") -> OpResult:
        """Append a tool result stored in the CAS (by ref); quarantined refs are refused."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.add_tool_result, ref, key)  # type: ignore[no-any-return]

    def admit_tool_result(self, tenant: str, session_id: str, ref: str, verdict: Any = None,
                          op_id: str = "") -> OpResult:
        """A verdict on a stored tool result (`verdict`, or the session's default detector when None);
        QUARANTINED evicts it with a proof (`result`: a ToolAdmission)."""
        key = op_id or uuid.uuid4().hex
        return self._call(tenant, session_id, SessionKernel.admit_tool_result, ref, verdict, key)  # type: ignore[no-any-return]

    def working_set(self, tenant: str, session_id: str, budget_tokens: int) -> Any:
        """HIT / FAULT / RECOMPUTE / REFUSE / ABSTAIN per piece (fleet.core.working_set.WorkingSet)."""
        return self._call(tenant, session_id, SessionKernel.working_set, budget_tokens)

    def evict_prefix(self, tenant: str, prompt: str | list[int], start: int = 0) -> int:
        """Policy eviction by name on every node: drop the cached blocks of this prompt prefix from
        position `start` (a block multiple inside the prompt) on, and everything below them, regardless of recency.
        Sessions that already adopted the blocks keep their own references. Returns blocks dropped fleet-wide.

        Raises:
            InvalidArgument: `start` is not a block multiple inside the prompt; nothing was dropped."""
        tokens = self._tokens(prompt)
        check_evict_start(start, self.spec.block_size, len(tokens))  # before any node drops anything
        total = 0
        for node in self.refresh_nodes():
            try:
                total += len(self.nodes.call(node, "evict_node", tenant, tokens, start)["block_ids"])
            except (NotFound, NodeGone):
                continue
        return total

    def close(self, tenant: str, session_id: str) -> None:
        """Drop the session's kernel and delete its op log; later calls raise NotFound. A close waits for a
        create, fork or rebuild of the session in flight in this fleet (the name's lock), and a rebuild in
        another controller never writes the record back (it writes only over the record it read). A close removes only
        the session whose record it read: one closed and created anew meanwhile by another controller stays."""
        with self._names.hold((tenant, session_id)):
            self._discard(self._stored(tenant, session_id))

    def release_session(self, tenant: str, session_id: str) -> None:
        """Drop the session's kernel from its host to free its KV memory (idle reaping); its record
        (state `idle`) and op log stay, so its next call regenerates it from the log."""
        with self._names.hold((tenant, session_id)):
            rec, raw = self._stored(tenant, session_id)
            self._where.pop((tenant, session_id), None)
            if rec.node in self.hosts:   # not the kernel of a session created anew meanwhile elsewhere
                self.nodes.call(rec.node, "close", tenant, session_id, None, rec.create_op_id or None)
            if rec.live:
                rec.released()
                self.registry.replace(rec, raw)  # not over a record closed (or rebuilt) meanwhile elsewhere

    def _discard(self, stored: Stored) -> None:
        """Close the session of the record read (`stored`): its kernel, then its op log, then its record (a crash
        half-way leaves the record, which a close removes again, never a kernel no record names). Each step
        removes only what that session's create or fork made (its op id): another controller may have closed the
        session and created its name anew meanwhile, and that session stays whole. NOTE: unconditional, a close
        that read the old record removed the new session's kernel, log and acknowledged record."""
        rec, raw = stored
        tenant, session_id, made = rec.tenant, rec.session, rec.create_op_id or None  # None: a record before op ids
        self._where.pop((tenant, session_id), None)
        self._close_kernel(rec.node, tenant, session_id, None, made)
        self._drop_log(tenant, session_id, made)
        while not self.registry.remove(tenant, session_id, raw):   # changed meanwhile (a rebuild, a release)
            now = self.registry.read(tenant, session_id)
            if now is None or now.rec.create_op_id != rec.create_op_id:
                return                                           # closed, or another session's now
            raw = now.raw

    # -- reads --------------------------------------------------------------------------------

    def digest(self, tenant: str, session_id: str) -> str:
        return str(self._call(tenant, session_id, SessionKernel.digest))

    def last_logits(self, tenant: str, session_id: str) -> np.ndarray | None:
        return self._call(tenant, session_id, SessionKernel.last_logits)  # type: ignore[no-any-return]

    def pieces(self, tenant: str, session_id: str) -> list[Any]:
        return list(self._call(tenant, session_id, SessionKernel.pieces))

    def tokens(self, tenant: str, session_id: str) -> list[int]:
        return list(self._call(tenant, session_id, SessionKernel.tokens))

    def info(self, tenant: str, session_id: str) -> dict[str, Any]:
        return dict(self._call(tenant, session_id, SessionKernel.info))

    def snapshot(self, tenant: str, session_id: str, include_tokens: bool = False) -> dict[str, Any]:
        """`info` (its row, as `list_sessions` lists it), `digest` and (if asked) `tokens` of one state of the
        session (SessionKernel.snapshot). NOTE: the row was the host's counts alone: a fork's GetSession named no
        parent and no state, where ListSessions named both."""
        snap = dict(self._call(tenant, session_id, SessionKernel.snapshot, include_tokens))
        stored = self.registry.read(tenant, session_id)
        if stored is not None:
            snap["info"] = session_row(stored.rec, snap["info"])
        return snap

    def node_stats(self) -> list[dict[str, Any]]:
        """One row per alive node of the fleet (sessions, cache, KV budget used)."""
        return [row for row in self.nodes.ask_all("stats").values() if isinstance(row, dict)]

    def _answer(self, node: str, method: str, *args: Any) -> Any:
        """A host's answer, or None when its node is gone (it is dropped)."""
        try:
            return self.nodes.call(node, method, *args)
        except NodeGone:
            return None

    def list_sessions(self, fleet: bool = True, tenant: str | None = None) -> list[dict[str, Any]]:
        """Rows: session, tenant, node, host (its actor name, also as `actor`), pid, tokens, bytes alone/shared,
        hit rate, quarantined
        spans, state, epoch, last active. `fleet=False` lists only this process's node."""
        here = ray.get_runtime_context().get_node_id()
        sups = [n for n in self.refresh_nodes() if fleet or node_of(n) == here]
        ask = self.nodes.ask_all("rows", tenant) if fleet else {n: self._answer(n, "rows", tenant) for n in sups}
        live = {(r["tenant"], r["session"]): r for rows in ask.values() if isinstance(rows, list) for r in rows}
        out = []
        for rec in self.registry.records(tenant):
            if not fleet and rec.node not in sups:
                continue  # fleet=True also lists sessions whose node is gone (state: lost)
            out.append(session_row(rec, live.get((rec.tenant, rec.session))))
        return out

    def release(self) -> None:
        """Let go of the fleet without stopping it (a detached fleet's controller stopping):
        hosts and their sessions stay up for the next controller to reattach."""
        self.nodes.hosts = {}
        self.store.close()

    def shutdown(self) -> None:
        """Kill the kernel hosts (every session they hold goes with them); the logs stay."""
        for s in self.hosts.values():
            ray.kill(s, no_restart=True)
        self.nodes.hosts = {}
        self.store.close()


def session_row(rec: SessionRecord, held: dict[str, Any] | None) -> dict[str, Any]:
    """A session's row: its registry record `rec` under its host's counts `held` (None: no host holds it)."""
    row = {**rec.to_dict(), **(held or {"tokens": 0})}
    row["state"] = LOST if rec.live and held is None else rec.state  # not held: lost until rebuilt
    row["hit_rate"] = row.get("adopted_tokens", 0) / row["tokens"] if row.get("tokens") else 0.0
    return row
