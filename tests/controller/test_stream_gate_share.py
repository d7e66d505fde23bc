"""The count share of StreamGate (controller/uploads.py): how many tenants it takes to hold every stream slot.

NOTE: before the share applied to the counts, 8 tenants at their cap of 8 held all 64 slots (the byte budget
had a share, the counts had none), and every other tenant's put or get was refused.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from controller.stream_gate import StreamGate
from controller.uploads import GetGate, GetLimits, UploadGate, UploadLimits
from fleet.core.errors import ResourceExhausted


def _take(gate: StreamGate, stack: contextlib.ExitStack, tenant: str) -> bool:
    """One more stream of one byte for `tenant`, held until `stack` closes; False when refused."""
    try:
        stack.enter_context(gate.admit(tenant, 1))
    except ResourceExhausted:
        return False
    return True


@pytest.mark.parametrize("make", [lambda: UploadGate(UploadLimits()), lambda: GetGate(GetLimits())])
def test_greedy_tenants_need_eleven_to_hold_every_slot_at_the_defaults(make: object) -> None:
    gate: StreamGate = make()  # type: ignore[operator]
    held: list[int] = []
    with contextlib.ExitStack() as stack:
        while _take(gate, stack, f"t{len(held)}"):  # each new tenant takes all it can, in turn
            tenant = f"t{len(held)}"
            while _take(gate, stack, tenant):
                pass
            held.append(gate.open[tenant])
        refused = f"t{len(held)}"
        assert gate.total_open == 64
    assert held == [8] * 7 + [4, 2, 1, 1]  # before the share: [8] * 8, and the ninth tenant refused
    assert refused == "t11"


def test_ten_tenants_in_any_order_leave_an_eleventh_a_slot() -> None:
    rng = random.Random(7)
    fewest_free = 64
    for _ in range(300):
        gate = UploadGate(UploadLimits())
        with contextlib.ExitStack() as stack:
            tries = [f"t{i}" for i in range(10) for _ in range(8)]  # every tenant tries for its cap
            rng.shuffle(tries)
            for tenant in tries:
                _take(gate, stack, tenant)
            fewest_free = min(fewest_free, 64 - gate.total_open)
            assert _take(gate, stack, "newcomer"), dict(gate.open)
    assert fewest_free >= 1


def test_the_share_refusal_names_the_flag_and_a_tenant_keeps_its_first_slot() -> None:
    gate = UploadGate(UploadLimits(total_uploads=4, tenant_uploads=4))
    with contextlib.ExitStack() as stack:
        assert _take(gate, stack, "bravo")
        assert [_take(gate, stack, "acme") for _ in range(2)] == [True, False]  # half of the 3 bravo leaves
        with pytest.raises(ResourceExhausted, match="--upload-tenant-share=0.5 of what other tenants leave"):
            gate.check("acme", 1)
        assert _take(gate, stack, "carol")  # half of the 2 left
        assert _take(gate, stack, "dave")  # half of the 1 left rounds to 0: a first stream still gets it
        assert not _take(gate, stack, "erin")  # all 4 held
        assert gate.total_open == 4


@pytest.mark.parametrize("make", [lambda: UploadGate(UploadLimits(tenant_uploads=8, total_uploads=8)),
                                  lambda: GetGate(GetLimits(tenant_gets=8, total_gets=8))])
def test_a_tenant_alone_gets_its_whole_cap_and_the_share_applies_once_others_hold_streams(make: object) -> None:
    """NOTE: alone, a tenant was held to the share of the total: with 8 in all and 8 per tenant it got 4."""
    gate: StreamGate = make()  # type: ignore[operator]
    with contextlib.ExitStack() as stack:
        assert sum(_take(gate, stack, "solo") for _ in range(9)) == 8
    with contextlib.ExitStack() as stack:
        assert _take(gate, stack, "other")
        assert sum(_take(gate, stack, "solo") for _ in range(9)) == 3  # half of the 7 the other leaves


def test_the_count_share_is_not_rounded_below_its_value() -> None:
    gate = UploadGate(UploadLimits(tenant_uploads=100, total_uploads=101, tenant_share=0.57))
    with contextlib.ExitStack() as stack:
        assert _take(gate, stack, "other")
        assert sum(_take(gate, stack, "t") for _ in range(100)) == 57  # int(0.57 * 100) is 56


def test_a_tenants_open_and_unread_gets_together_stay_within_its_cap() -> None:
    """NOTE: the unread calls alone were checked: a tenant with 7 of them opened 8 more (15 RPC slots)."""
    gate = GetGate(GetLimits(tenant_gets=8, total_gets=64))
    gate.unread["acme"] = 7
    with contextlib.ExitStack() as stack:
        assert sum(_take(gate, stack, "acme") for _ in range(8)) == 1
        assert sum(_take(gate, stack, "bravo") for _ in range(8)) == 8  # another tenant: its own cap
    gate = GetGate(GetLimits(tenant_gets=8, total_gets=16))
    for t in "abcdefgh":  # 8 tenants with 2 unread calls each: the total of --max-gets
        gate.unread[t] = 2
    with contextlib.ExitStack() as stack:
        assert not _take(gate, stack, "newcomer")
