"""Per-tenant limits of the session fleet: quotas, call lanes, and what counts as idle.

One tenant must not starve the others (issue #13, finding 3). Three mechanisms, all per tenant:

  * quotas: at most `max_sessions_per_tenant` sessions, `max_kv_bytes_per_tenant` bytes of KV
    cache and `max_history_tokens_per_tenant` tokens of session history (what the op logs hold:
    every piece a session appended, evicted ones included, plus a charge per append: `oplog.history_tokens`); a
    create, fork, append or generate that would pass one is refused with RESOURCE_EXHAUSTED
    naming the quota and its flag, before anything is logged or spawned;
  * lanes: each tenant's session calls run on its own few threads (`tenant_concurrency`), so a
    tenant whose calls wait on a slow or stuck actor parks only its own lane, never another
    tenant's reads (`TenantLanes`);
  * idle reaping: a session no call touched for `idle_ttl_s` has its actor released (its Ray
    worker process and KV memory freed); its registry record and op log stay, so its next call
    regenerates it bit-identically from the log (controller/servicers/sessions.py runs the loop).

KV bytes are counted as a session's tokens times the kernel's bytes per token (K, Kraw and V of
every layer), whether or not its prefix blocks are shared with another session: the bound holds
even if every shared block were to be copied. History is counted per session from its log: a fork's
log starts with a copy of its parent's, so a fork is charged its parent's history again. Closing a
session frees both. The ledger lives in the controller's memory and is rebuilt from the registry and
the op logs the first time a tenant calls after a restart.
"""

from __future__ import annotations

import argparse
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fleet.core.errors import InvalidArgument, ResourceExhausted
from fleet.core.oplog import HISTORY_OP_CHARGE, history_charge

DEFAULT_MAX_SESSIONS = 64
DEFAULT_MAX_KV_BYTES = 1 << 30
DEFAULT_MAX_HISTORY_TOKENS = 1 << 23  # about 64 sessions (the session quota) x a 128k-token context each
DEFAULT_IDLE_TTL_S = 1800.0
DEFAULT_TENANT_CONCURRENCY = 4
MIN_REAP_INTERVAL_S, MAX_REAP_INTERVAL_S = 0.25, 60.0


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """Per-tenant limits (0 turns a quota or the reaping off).

    Invariants: every field >= 0; tenant_concurrency >= 1.
    """

    max_sessions_per_tenant: int = DEFAULT_MAX_SESSIONS
    max_kv_bytes_per_tenant: int = DEFAULT_MAX_KV_BYTES
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S
    tenant_concurrency: int = DEFAULT_TENANT_CONCURRENCY
    max_history_tokens_per_tenant: int = DEFAULT_MAX_HISTORY_TOKENS

    def __post_init__(self) -> None:
        for flag, v in (("--max-sessions-per-tenant", self.max_sessions_per_tenant),
                        ("--max-kv-bytes-per-tenant", self.max_kv_bytes_per_tenant),
                        ("--session-idle-ttl", self.idle_ttl_s),
                        ("--max-history-tokens-per-tenant", self.max_history_tokens_per_tenant)):
            if not math.isfinite(v) or v < 0:  # NOTE: a NaN TTL once passed `< 0` and reaped every session at once
                raise InvalidArgument(f"{flag} must be a finite number >= 0 (0: no limit), got {v}")
        if self.tenant_concurrency < 1:
            raise InvalidArgument(f"--session-concurrency-per-tenant must be >= 1, got {self.tenant_concurrency}")

    @property
    def reap_interval_s(self) -> float:
        """How often the reaper looks: a quarter of the TTL, within [0.25 s, 60 s]."""
        return min(max(self.idle_ttl_s / 4, MIN_REAP_INTERVAL_S), MAX_REAP_INTERVAL_S)


@dataclass(slots=True)
class TenantLedger:
    """Tokens held, and history logged, per session of each tenant, with the growth of calls in
    flight reserved.

    Used from the event loop only (no locks): a check and its reservation happen with no await
    between them, so concurrent calls of one tenant can never pass a quota together.
    """

    bytes_per_token: int
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    history: dict[str, dict[str, int]] = field(default_factory=dict)
    pending_history: dict[str, int] = field(default_factory=dict)

    def seeded(self, tenant: str) -> bool:
        return tenant in self.tokens

    def seed(self, tenant: str, sessions: dict[str, tuple[int, int]]) -> None:
        """`sessions`: (tokens held, history charged) per session, as its op log says."""
        if tenant not in self.tokens:
            self.tokens[tenant] = {sid: held for sid, (held, _) in sessions.items()}
            self.history[tenant] = {sid: hist for sid, (_, hist) in sessions.items()}

    def history_tokens(self, tenant: str) -> int:
        return sum(self.history.get(tenant, {}).values()) + self.pending_history.get(tenant, 0)

    def kv_bytes(self, tenant: str) -> int:
        held = sum(self.tokens.get(tenant, {}).values()) + self.pending.get(tenant, 0)
        return held * self.bytes_per_token

    def reserve(self, limits: SessionLimits, tenant: str, num_tokens: int, new_session: str | None = None,
                history: int | None = None) -> tuple[int, int]:
        """Reserve `num_tokens` more tokens held and `history` more charged to history (default: one
        append of `num_tokens`), and, with `new_session`, one more session, for a call about to run;
        `release` it when the call ends. Returns the reservation.

        Raises:
            ResourceExhausted: the tenant would pass a quota; nothing is reserved.
        """
        history = history_charge(num_tokens) if history is None else history
        sessions = self.tokens.setdefault(tenant, {})
        cap = limits.max_sessions_per_tenant
        if new_session is not None and cap and len(sessions) >= cap:
            raise ResourceExhausted(
                f"tenant {tenant!r} already has {len(sessions)} sessions, its quota "
                f"(--max-sessions-per-tenant {cap}); close sessions it no longer needs, or ask the operator "
                "to raise the quota")
        want, cap_bytes = self.kv_bytes(tenant) + num_tokens * self.bytes_per_token, limits.max_kv_bytes_per_tenant
        if cap_bytes and want > cap_bytes:
            raise ResourceExhausted(
                f"tenant {tenant!r} would hold {want:,} bytes of KV cache ({num_tokens} more tokens at "
                f"{self.bytes_per_token:,} bytes each), over its quota (--max-kv-bytes-per-tenant {cap_bytes:,}); "
                "evict pieces or close sessions, or ask the operator to raise the quota")
        want, cap = self.history_tokens(tenant) + history, limits.max_history_tokens_per_tenant
        if cap and want > cap:
            logs = self.history.get(tenant, {})
            top = sorted(logs, key=lambda s: (-logs[s], s))[:3]
            raise ResourceExhausted(
                f"tenant {tenant!r} would log {want:,} tokens of session history ({history:,} more), over its "
                f"quota (--max-history-tokens-per-tenant {cap:,}). A session's op log keeps every piece it "
                "appended, evicted ones included, so evicting frees none of it: close sessions it no longer "
                "needs (a fork copies its parent's history), or ask the operator to raise the quota. Its "
                f"longest: {', '.join(f'{s} ({logs[s]:,})' for s in top)}")
        if new_session is not None:
            sessions[new_session] = 0
            self.history.setdefault(tenant, {})[new_session] = 0
        self.pending[tenant] = self.pending.get(tenant, 0) + num_tokens
        self.pending_history[tenant] = self.pending_history.get(tenant, 0) + history
        return num_tokens, history

    def release(self, tenant: str, reserved: tuple[int, int]) -> None:
        self.pending[tenant] = self.pending.get(tenant, 0) - reserved[0]
        self.pending_history[tenant] = self.pending_history.get(tenant, 0) - reserved[1]

    def update(self, tenant: str, session_id: str, num_tokens: int, history: int = -1) -> None:
        """What a call answered: the session now holds `num_tokens` tokens, and its log `history` (as its
        host counts it, `oplog.history_tokens`; -1: not said). A session the ledger no longer counts (closed
        while the call was in flight) stays uncounted."""
        sessions = self.tokens.get(tenant)
        if sessions is not None and session_id in sessions:
            sessions[session_id] = int(num_tokens)
            if history >= 0:
                self.history.setdefault(tenant, {})[session_id] = int(history)

    def charge(self, tenant: str, session_id: str, reserved: tuple[int, int]) -> None:
        """A call whose outcome is unknown (it timed out while its host may still apply and log it) keeps its
        reservation (tokens, history) as a charge, until the session's next answer says what it holds and logs.
        NOTE: only the history was kept: the tokens of an append cut short were not counted while its host held
        them, and the tenant went on past its KV quota."""
        hist, held = self.history.get(tenant), self.tokens.get(tenant)
        if hist is not None and held is not None and session_id in hist and session_id in held:
            held[session_id] += int(reserved[0])
            hist[session_id] += int(reserved[1])

    def add(self, tenant: str, session_id: str, num_tokens: int, history: int) -> None:
        """A create or fork completed: the new session holds `num_tokens` tokens, and its log `history`."""
        self.tokens.setdefault(tenant, {})[session_id] = int(num_tokens)
        self.history.setdefault(tenant, {})[session_id] = int(history)

    def drop(self, tenant: str, session_id: str) -> None:
        self.tokens.get(tenant, {}).pop(session_id, None)
        self.history.get(tenant, {}).pop(session_id, None)

    def num_tokens(self, tenant: str, session_id: str) -> int:
        return self.tokens.get(tenant, {}).get(session_id, 0)

    def num_history(self, tenant: str, session_id: str) -> int:
        return self.history.get(tenant, {}).get(session_id, 0)


class TenantLanes:
    """One small thread pool per tenant for its (blocking) session calls.

    A call that blocks (an actor that does not answer parks its thread up to the fleet's call
    timeout) holds a thread of its own tenant's lane only: another tenant's calls run on threads
    no other tenant can take. Calls past a lane's width wait in that lane's queue, not on a
    thread; at most QUEUE_FACTOR x width of them per tenant, so one tenant cannot hold all of the
    server's concurrent RPCs either (past that: RESOURCE_EXHAUSTED, retry later).
    """

    QUEUE_FACTOR = 16

    def __init__(self, width: int) -> None:
        self.width = width
        self._lanes: dict[str, ThreadPoolExecutor] = {}
        self._load: dict[str, int] = {}

    def acquire(self, tenant: str) -> ThreadPoolExecutor:
        """Admit one call of `tenant` (running or waiting in its lane); `release` it when it ends.

        Raises:
            ResourceExhausted: the tenant already has QUEUE_FACTOR x width calls admitted.
        """
        n, cap = self._load.get(tenant, 0), self.QUEUE_FACTOR * self.width
        if n >= cap:
            raise ResourceExhausted(
                f"tenant {tenant!r} already has {n} session calls running or waiting ({self.QUEUE_FACTOR} x "
                f"--session-concurrency-per-tenant {self.width}); retry when some have finished")
        self._load[tenant] = n + 1
        return self.lane(tenant)

    def release(self, tenant: str) -> None:
        self._load[tenant] -= 1
        if not self._load[tenant]:
            del self._load[tenant]

    def prune(self) -> int:
        """Shut down the lanes of tenants with no call running or waiting (a tenant that went
        away keeps no threads); the next call of such a tenant starts a fresh lane. Returns how
        many lanes were shut down. Called from the event loop, like acquire/release."""
        idle = [t for t in self._lanes if t not in self._load]
        for t in idle:
            self._lanes.pop(t).shutdown(wait=False)
        return len(idle)

    def lane(self, tenant: str) -> ThreadPoolExecutor:
        pool = self._lanes.get(tenant)
        if pool is None:
            pool = self._lanes[tenant] = ThreadPoolExecutor(self.width, thread_name_prefix=f"kvfleet-sessions-{tenant}")
        return pool

    def shutdown(self) -> list[ThreadPoolExecutor]:
        """Drop every lane's queued calls; returns the lanes, whose running calls may not have ended yet."""
        pools = list(self._lanes.values())
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        self._lanes.clear()
        return pools


# -- flags (shared by `kvfleet controller` and `kvfleet up`) ------------------------------------------

def add_session_flags(p: argparse.ArgumentParser) -> None:
    """The per-tenant session limits' flags; defaults are SessionLimits'."""
    d = SessionLimits()
    p.add_argument("--max-sessions-per-tenant", type=int, default=d.max_sessions_per_tenant,
                   help=f"sessions one tenant may hold (default {d.max_sessions_per_tenant}; 0: no limit)")
    p.add_argument("--max-kv-bytes-per-tenant", type=int, default=d.max_kv_bytes_per_tenant,
                   help=f"bytes of KV cache one tenant's sessions may hold, tokens x bytes per token "
                        f"(default {d.max_kv_bytes_per_tenant} = 1 GiB; 0: no limit)")
    p.add_argument("--max-history-tokens-per-tenant", type=int, default=d.max_history_tokens_per_tenant,
                   help=f"tokens of session history one tenant's op logs may hold: every piece appended, evicted "
                        f"ones included, plus {HISTORY_OP_CHARGE} per append; a fork is charged its parent's "
                        f"(default {d.max_history_tokens_per_tenant:,}; 0: no limit)")
    p.add_argument("--session-idle-ttl", type=float, default=d.idle_ttl_s,
                   help=f"seconds without a call after which a session's actor is released; its op log "
                        f"stays and its next call regenerates it (default {d.idle_ttl_s:.0f}; 0: never)")
    p.add_argument("--session-concurrency-per-tenant", type=int, default=d.tenant_concurrency,
                   help=f"session calls of one tenant running at once; more wait in that tenant's queue "
                        f"(default {d.tenant_concurrency})")


def session_limits_from(args: argparse.Namespace) -> SessionLimits:
    """SessionLimits from the flags; InvalidArgument (naming the flag) on a bad value."""
    return SessionLimits(args.max_sessions_per_tenant, args.max_kv_bytes_per_tenant, args.session_idle_ttl,
                         args.session_concurrency_per_tenant, args.max_history_tokens_per_tenant)
