"""Placement rule, tenant salts and the session record's model_id (pure: no Ray needed)."""

from __future__ import annotations

from workers.placement import SALT_BASE, NodeOffer, choose_node, tenant_salt
from workers.registry import SessionRecord


def test_choose_node_prefers_warm_prefix_then_load_then_id() -> None:
    offers = [NodeOffer("n1", 0, 0), NodeOffer("n2", 32, 9), NodeOffer("n3", 32, 4)]
    assert choose_node(offers) == "n3"                            # warmest, then least loaded
    assert choose_node([NodeOffer("n2", 0, 3), NodeOffer("n1", 0, 3)]) == "n1"
    assert choose_node([NodeOffer("n1", 0, 1), NodeOffer("n2", 0, 0)]) == "n2"


def test_tenant_salts_differ_and_lie_outside_any_vocabulary() -> None:
    a, b = tenant_salt("acme", 16), tenant_salt("globex", 16)
    assert len(a) == 16 and a != b and a == tenant_salt("acme", 16)
    assert min(a + b) >= SALT_BASE


def test_a_rebuild_prefers_a_node_whose_kernel_has_the_sessions_model_id() -> None:
    """A lost session is rebuilt bit-identically only on a kernel of its model_id (weights, dtype, CPU code path)."""
    offers = [NodeOffer("a", 0, 0, model_id="avx2"), NodeOffer("b", 0, 3, model_id="avx512"),
              NodeOffer("c", 0, 5, model_id="avx512")]
    assert choose_node(offers) == "a"                              # control: load alone picks the other code path
    assert choose_node(offers, model_id="avx512") == "b"           # the least loaded of its own
    assert choose_node(offers, model_id="avx2") == "a"
    full = [NodeOffer("a", 0, 0, model_id="avx2"), NodeOffer("b", 0, 2, max_sessions=2, model_id="avx512")]
    assert choose_node(full, model_id="avx512") == "a"            # none of its own has room: rebuilt all the same
    assert choose_node(offers, model_id="") == "a"                 # unknown (an old record): no preference


def test_a_session_record_keeps_its_model_id_and_says_when_a_rebuild_changed_it() -> None:
    rec = SessionRecord("acme", "s1", "n1")
    rec.acknowledged(32, model_id="avx512")
    rec.lose()
    assert not rec.rebuilt("n2", "avx512") and (rec.model_id, rec.rebuilt_from_model_id) == ("avx512", "")
    rec.lose()
    assert rec.rebuilt("n3", "avx2") and (rec.model_id, rec.rebuilt_from_model_id) == ("avx2", "avx512")
    rec.lose()
    assert not rec.rebuilt("n3", "") and rec.model_id == "avx2"   # a host that does not say changes nothing
    assert SessionRecord.from_dict(rec.to_dict()) == rec


def test_a_record_written_before_model_id_loads_and_flags_nothing() -> None:
    old = {"tenant": "acme", "session": "s1", "node": "n1", "state": "active", "epoch": 0, "created": 1.0,
           "adopted_tokens": 0, "parent": "", "moved_bytes": 0, "regenerated": 0, "witness": None}
    rec = SessionRecord.from_dict(old)
    assert (rec.model_id, rec.rebuilt_from_model_id) == ("", "")
    rec.lose()
    assert not rec.rebuilt("n2", "avx2") and (rec.model_id, rec.rebuilt_from_model_id) == ("avx2", "")


def test_a_host_name_carries_the_host_api_version() -> None:
    """A controller of a new host API never reattaches to a previous version's detached hosts (found by name).
    NOTE: the name had no version: a new controller called an old host with arguments it refused."""
    from workers import placement

    name = placement.host_name("n1:gpu1", "abc")
    assert name == f"host:abc-v{placement.HOST_API_VERSION}:n1:gpu1" and name.split(":")[1].startswith("abc")
    real, placement.HOST_API_VERSION = placement.HOST_API_VERSION, placement.HOST_API_VERSION + 1
    try:
        assert placement.host_name("n1:gpu1", "abc") != name
    finally:
        placement.HOST_API_VERSION = real


def test_the_previous_versions_host_names_are_the_scopes_older_ones() -> None:
    """What a new controller stops at start (FleetNodes.stop_previous_hosts): its scope's hosts of an older version,
    or of none (named before versions); never its own version's, a newer one's, another scope's, nor other actors."""
    from workers.placement import HOST_API_VERSION, host_name, previous_host_names

    v = HOST_API_VERSION
    older = [f"host:abc-v{v - 1}:n1", "host:abc:n1", "host:abc:n1:gpu1", f"host:abc-v{v - 1}:n2:gpu3"]
    kept = [host_name("n1", "abc"), f"host:abc-v{v + 1}:n1", f"host:abd-v{v - 1}:n1", "host:abd:n1",
            "host:abc-vx:n1", "router:abc", "abc"]
    assert previous_host_names([*kept, *older], "abc") == older and previous_host_names(kept, "abc") == []
