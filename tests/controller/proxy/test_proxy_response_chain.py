"""A tool output quarantined after it was answered (an operator's verdict by hash, a heavier judge's late verdict)
stays in the conversation vLLM stored for that response: a follow-up naming the response (`previous_response_id`), or
a later one of its chain, has the worker read it again, and the proxy cannot withhold what the follow-up does not
resend. The proxy remembers which tool outputs each stored response's request carried, and its parent, and refuses a
follow-up whose chain holds one quarantined now (409, naming what to do); a chain whose outputs stay clean is answered.

NOTE: before, the follow-up was answered 200 from the stored history, the quarantined output in it. Real controller,
proxy and stand-ins (`kvfleet sim-vllm` keeps /v1/responses answers for `previous_response_id`, as vLLM does).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from support.proxy_fleet import MODEL, Fleet, start_fleet

from controller.proxy.lineage import Lineage, Record

BENIGN = "Order 4412 shipped on 3 March via DHL, tracking number JD014600006512345678, expected delivery Friday."
OTHER = "Invoice 77 paid in full on 2 April; the receipt was mailed to the billing address on file."


def _input(output: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Where is my order?"},
            {"type": "function_call", "call_id": "call_1", "name": "order_status", "arguments": '{"id": 4412}'},
            {"type": "function_call_output", "call_id": "call_1", "output": output}]


async def _ask(fleet: Fleet, body: dict[str, Any], who: str = "a") -> tuple[int, dict[str, Any]]:
    status, _, raw = await fleet.post("/v1/responses", {"model": MODEL, "max_output_tokens": 4, **body}, who)
    return status, json.loads(raw)


async def _chain(fleet: Fleet, output: str, who: str = "a") -> tuple[str, str]:
    """(the first response's id, its follow-up's): a tool output, then a turn that does not resend it."""
    status, first = await _ask(fleet, {"input": _input(output)}, who)
    assert status == 200, first
    status, second = await _ask(fleet, {"input": "And when will it arrive?", "previous_response_id": first["id"]}, who)
    assert status == 200, second
    return first["id"], second["id"]


async def test_a_follow_up_whose_chain_holds_an_output_quarantined_later_is_refused(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1)
    try:
        (sim,) = fleet.sims.values()
        rid1, rid2 = await _chain(fleet, BENIGN)
        clean1, clean2 = await _chain(fleet, OTHER)
        assert sim.received.contains(BENIGN)  # judged clean: the worker stored it with rid1's conversation

        await fleet.op.set_verdict(hashlib.sha256(BENIGN.encode()).hexdigest(), "QUARANTINED",
                                   reasons=["operator: leaked tracking data"])
        for rid in (rid1, rid2):  # the response that carried it, and a later one of its chain
            status, got = await _ask(fleet, {"input": "Thanks!", "previous_response_id": rid})
            assert status == 409, got  # NOTE: before, 200: answered from the stored history, BENIGN in it
            err = got["error"]
            assert err["param"] == "previous_response_id" and err["type"] == "ConflictError"
            assert "quarantined" in err["message"] and "without previous_response_id" in err["message"]
        assert not any(rid2 in raw for _, raw, _ in sim.received.items)  # nothing was forwarded

        status, got = await _ask(fleet, {"input": "Thanks!", "previous_response_id": clean2})  # control: clean
        assert status == 200 and got["previous_response_id"] == clean2, got
        status, got = await _ask(fleet, {"input": _input(BENIGN)})  # what the client can do: resend it all
        assert status == 200 and got["kvfleet"]["quarantined"][0]["where"] == "input[2].output", got
    finally:
        await fleet.stop()


async def test_a_response_the_proxy_has_no_record_of_is_answered_and_counted(tmp_path: Path) -> None:
    """Fail open (docs/proxy.md): a proxy that restarted, or another replica, knows no chain; the follow-up is
    answered, logged and counted in kvfleet_proxy_response_chains_total{outcome="unknown"}."""
    fleet = await start_fleet(tmp_path, num_workers=1)
    try:
        rid1, _ = await _chain(fleet, BENIGN)
        fleet.proxy.lineage = Lineage()  # a restarted proxy
        await fleet.op.set_verdict(hashlib.sha256(BENIGN.encode()).hexdigest(), "QUARANTINED", reasons=["op"])
        status, got = await _ask(fleet, {"input": "Thanks!", "previous_response_id": rid1})
        assert status == 200, got
        assert fleet.proxy.metrics.chains.labels("unknown")._value.get() == 1
    finally:
        await fleet.stop()


async def test_the_part_of_a_chain_the_proxy_holds_is_checked_when_the_rest_is_not(tmp_path: Path) -> None:
    """A conversation begun before the proxy restarted goes on through it: a turn carries a tool output (judged
    clean, recorded), which is quarantined later. A follow-up naming that turn's response is refused, though the
    chain's first response is not held. NOTE: before, the whole chain counted as unknown and the follow-up was
    answered 200 from the stored history, the quarantined output the proxy had recorded in it."""
    fleet = await start_fleet(tmp_path, num_workers=1)
    try:
        rid1, _ = await _chain(fleet, BENIGN)
        fleet.proxy.lineage = Lineage()  # a restarted proxy: rid1's chain is not held
        body = {"input": [{"type": "function_call", "call_id": "call_2", "name": "invoice", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "call_2", "output": OTHER}],
                "previous_response_id": rid1}
        status, later = await _ask(fleet, body)
        assert status == 200, later
        await fleet.op.set_verdict(hashlib.sha256(OTHER.encode()).hexdigest(), "QUARANTINED", reasons=["op"])
        status, got = await _ask(fleet, {"input": "Thanks!", "previous_response_id": later["id"]})
        assert status == 409 and "quarantined" in got["error"]["message"], got
        # control: with nothing quarantined in the part held, the follow-up is answered and counted unknown
        status, got = await _ask(fleet, {"input": "Thanks!", "previous_response_id": rid1})
        assert status == 200 and fleet.proxy.metrics.chains.labels("unknown")._value.get() >= 1, got
    finally:
        await fleet.stop()


def _rec(parent: str | None, *names: str) -> Record:
    return Record(parent, b"".join(hashlib.sha256(n.encode()).digest() for n in names))


def _hex(*names: str) -> list[str]:
    return [hashlib.sha256(n.encode()).hexdigest() for n in names]


def test_the_records_are_bounded_per_tenant_and_walk_the_chain() -> None:
    rec = Lineage(per_tenant=3, digests_per_tenant=4, max_tenants=2)
    rec.add("a", "resp_1", _rec(None, "r1"))
    rec.add("a", "resp_2", _rec("resp_1"))
    rec.add("a", "resp_3", _rec("resp_2", "r3", "r1"))
    assert rec.chain("a", "resp_3") == _hex("r3", "r1")
    assert rec.chain("b", "resp_3") is None  # a tenant's records are its own
    for i in range(10):  # another tenant's flood pushes out its own records only
        rec.add("b", f"resp_b{i}", _rec(None, f"x{i}"))
    assert rec.chain("a", "resp_3") == _hex("r3", "r1") and rec.chain("b", "resp_b6") is None
    assert rec.chain("b", "resp_b9") == _hex("x9")
    rec.add("b", "resp_big", _rec(None, "1", "2", "3"))  # digests bounded too: 1 + 3 of 4, the rest pushed out
    assert rec.chain("b", "resp_b9") == _hex("x9") and rec.chain("b", "resp_b8") is None
    rec.add("b", "resp_huge", _rec(None, "1", "2", "3", "4", "5"))  # over the bound alone: not kept
    assert rec.chain("b", "resp_huge") is None and rec.chain("b", "resp_big") is not None
    rec.add("a", "resp_4", _rec("resp_3"))  # resp_1 leaves: the chain past it is unknown
    assert rec.chain("a", "resp_4") is None and rec.chain("a", "resp_2") is None
    assert rec.walk("a", "resp_4") == (_hex("r3", "r1"), False)  # what is held of it is still read
    rec.add("c", "resp_c", _rec(None))  # a third tenant: the least recently active one leaves with its records
    assert rec.chain("b", "resp_big") is None and rec.chain("c", "resp_c") == []
    rec.add("a", "resp_loop", _rec("resp_loop"))  # a cycle ends
    assert rec.chain("a", "resp_loop") is None
