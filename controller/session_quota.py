"""The session fleet's token quota (controller/quotas.py): the ledger of the tokens each tenant's sessions hold and
the history their logs are charged, made once the fleet is built; a tenant's counts are rebuilt from the registry
and the op logs the first time it calls (a restart loses nothing).

Sessions (controller/sessions.py; its calls: controller/session_calls.py) reserves a call's tokens in it before the
call runs and settles them when the call ends, and sets a session's counts from each answer. What reads the store
here runs on the tenant's lane: the fleet and the lane are Sessions' own (`Sessions.get_fleet`, `Sessions._run`),
passed in.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from controller.quotas import TenantLedger
from fleet.core.oplog import history_tokens, num_tokens, parse_log
from fleet.core.session_types import SessionRow

Run = Callable[..., Awaitable[Any]]  # run(tenant, fn, *args): fn(*args) on the tenant's lane (Sessions._run)


class SessionQuota:
    """The tenants' token ledger, counted from the fleet's store."""

    def __init__(self, fleet: Callable[[], Awaitable[Any]], run: Run) -> None:
        self._fleet, self._run = fleet, run  # get the fleet (built on first use); run on a tenant's lane
        self.fleet: Any = None
        self.ledger: TenantLedger | None = None
        self._seed_locks: dict[str, asyncio.Lock] = {}  # per tenant, while its counts are rebuilt after a start

    def open(self, fleet: Any) -> None:
        """The fleet is built: the ledger counts a token at its kernel's KV bytes per token."""
        self.fleet = fleet
        self.ledger = TenantLedger(fleet.kernel.block_bytes // fleet.kernel.block_size)

    async def counted(self, tenant: str) -> TenantLedger:
        """The ledger, with `tenant`'s sessions counted (rebuilt from the store the first time)."""
        if self.ledger is None:
            await self._fleet()
        ledger = self.ledger
        assert ledger is not None
        if not ledger.seeded(tenant):
            # NOTE: one lock and the shared admin threads for every tenant made a tenant's first call after a
            # restart wait for another's logs to be read (7-11 -> 386-405 ms behind 4M tokens of history)
            lock = self._seed_locks.setdefault(tenant, asyncio.Lock())
            async with lock:
                if not ledger.seeded(tenant):
                    ledger.seed(tenant, await self._run(tenant, self._held_tokens, tenant))
            self._seed_locks.pop(tenant, None)
        return ledger

    def _held_tokens(self, tenant: str) -> dict[str, tuple[int, int]]:
        """(tokens held, history charged) per registered session of `tenant`, from the op logs (a restart
        loses nothing)."""
        from workers.registry import CREATING

        store, out = self.fleet.store, {}
        for r in self.fleet.registry.records(tenant):
            if r.state != CREATING:
                ops = parse_log(store.oplog_read(tenant, r.session))
                out[r.session] = num_tokens(ops), history_tokens(ops)
        return out

    def set_tokens(self, tenant: str, sid: str, num_tokens: int, history: int = -1) -> None:
        """The session now holds `num_tokens` tokens and its log `history` (a call's answer; -1: not said)."""
        ledger = self.ledger
        if ledger is not None and ledger.seeded(tenant):
            ledger.update(tenant, sid, num_tokens, history)

    def with_history(self, row: SessionRow) -> SessionRow:
        """The row's history as the quota charges it, where the ledger counts the tenant: a session no host
        holds (idle, lost) has no info of its own, and a charge may be pending a timed-out call's answer."""
        ledger = self.ledger
        if ledger is None or not ledger.seeded(row.tenant) or row.session_id not in ledger.history.get(row.tenant, {}):
            return row
        return dataclasses.replace(row, history_tokens=ledger.num_history(row.tenant, row.session_id))

    def blob_tokens(self, tenant: str, ref: str) -> int:
        """An upper bound of a stored tool result's tokens (its size: a token is >= 1 byte); 0 when
        the blob is missing or malformed (the append itself then says why)."""
        try:
            return int(self.fleet.store.stat(ref, tenant).size)
        except Exception:  # noqa: BLE001 - the append reports the real error
            return 0

    def forget(self, tenant: str, sid: str) -> None:
        if self.ledger is not None:
            self.ledger.drop(tenant, sid)
