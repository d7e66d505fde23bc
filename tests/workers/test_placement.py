"""Placement rule and tenant salts (pure: no Ray needed)."""

from __future__ import annotations

from workers.placement import SALT_BASE, NodeOffer, choose_node, tenant_salt


def test_choose_node_prefers_warm_prefix_then_load_then_id() -> None:
    offers = [NodeOffer("n1", 0, 0), NodeOffer("n2", 32, 9), NodeOffer("n3", 32, 4)]
    assert choose_node(offers) == "n3"                            # warmest, then least loaded
    assert choose_node([NodeOffer("n2", 0, 3), NodeOffer("n1", 0, 3)]) == "n1"
    assert choose_node([NodeOffer("n1", 0, 1), NodeOffer("n2", 0, 0)]) == "n2"


def test_tenant_salts_differ_and_lie_outside_any_vocabulary() -> None:
    a, b = tenant_salt("acme", 16), tenant_salt("globex", 16)
    assert len(a) == 16 and a != b and a == tenant_salt("acme", 16)
    assert min(a + b) >= SALT_BASE
