"""The bounds on failed puts a Redis store remembers to give back (fleet/cas/redis_undropped.py): per tenant and in
all, one tenant's failures pushing out only its own. The real-Redis case (a restart, then the puts given back) is in
test_cas_redis_restart.py."""

from __future__ import annotations

from fleet.cas.redis_undropped import Undropped


def test_a_tenant_keeps_its_newest_and_pushes_out_only_its_own() -> None:
    u: Undropped[str] = Undropped(per_tenant=3, total=8)
    u.add("bravo", "b0")
    for i in range(10):
        u.add("acme", f"a{i}")
    assert u.take_all() == [("bravo", "b0"), ("acme", "a7"), ("acme", "a8"), ("acme", "a9")]
    assert len(u) == 0 and u.take_all() == []


def test_a_full_total_pushes_out_the_largest_tenants_oldest() -> None:
    u: Undropped[str] = Undropped(per_tenant=3, total=4)
    for item in ("a0", "a1", "a2"):
        u.add("acme", item)
    u.add("bravo", "b0")  # the total is full now
    u.add("carol", "c0")  # acme holds the most: its oldest goes, bravo's stays
    assert (len(u), u.held("acme"), u.held("bravo"), u.held("carol")) == (4, 2, 1, 1)
    u.add("dave", "d0")  # acme again (2 against 1 each)
    u.add("erin", "e0")  # a tie at one each: the adding tenant's own (its only one) goes, nobody else's
    assert sorted(u.take_all()) == [("acme", "a2"), ("bravo", "b0"), ("carol", "c0"), ("dave", "d0")]

