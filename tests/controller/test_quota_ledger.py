"""TenantLedger (controller/quotas.py) as a unit: the growth of calls in flight is reserved, so concurrent
calls of one tenant can never pass a quota together, each checked against what the others already reserved."""

from __future__ import annotations

import pytest

from controller.quotas import SessionLimits, TenantLedger
from fleet.core.errors import ResourceExhausted
from fleet.core.oplog import HISTORY_OP_CHARGE

BYTES_PER_TOKEN = 8


def _ledger() -> TenantLedger:
    ledger = TenantLedger(bytes_per_token=BYTES_PER_TOKEN)
    ledger.seed("acme", {"s1": (0, 0), "s2": (0, 0)})
    return ledger


def test_two_reservations_in_flight_cannot_pass_the_kv_quota_together() -> None:
    """Quota 100 tokens of KV; two appends of 60 tokens in flight (no release between them): the second is
    refused, though either alone fits. Control: once the first is released, the second fits."""
    limits = SessionLimits(max_kv_bytes_per_tenant=100 * BYTES_PER_TOKEN, max_history_tokens_per_tenant=0)
    ledger = _ledger()
    first = ledger.reserve(limits, "acme", 60)
    with pytest.raises(ResourceExhausted, match="--max-kv-bytes-per-tenant"):
        ledger.reserve(limits, "acme", 60)
    assert first == (60, 60 + HISTORY_OP_CHARGE)
    assert ledger.kv_bytes("acme") == 60 * BYTES_PER_TOKEN  # the first's reservation; the refused one's none
    ledger.release("acme", first)
    assert ledger.kv_bytes("acme") == 0
    assert ledger.reserve(limits, "acme", 60) == first  # control: alone, the same call fits


def test_two_reservations_in_flight_cannot_pass_the_history_quota_together() -> None:
    """Quota 100 tokens of history; two appends of 40 tokens (charged 40 + HISTORY_OP_CHARGE = 56 each) in
    flight: the second is refused. Control: once the first is released, the second fits."""
    limits = SessionLimits(max_kv_bytes_per_tenant=0, max_history_tokens_per_tenant=100)
    ledger = _ledger()
    first = ledger.reserve(limits, "acme", 40)
    with pytest.raises(ResourceExhausted, match="--max-history-tokens-per-tenant"):
        ledger.reserve(limits, "acme", 40)
    assert first == (40, 56)
    assert ledger.history_tokens("acme") == 56  # the first's reservation; the refused one's none
    ledger.release("acme", first)
    assert ledger.history_tokens("acme") == 0
    assert ledger.reserve(limits, "acme", 40) == first  # control: alone, the same call fits
