"""`--fair-priority`: one tenant's flood does not queue another tenant's request behind all of it
(controller/proxy/fair.py). A real proxy and controller in front of a clocked stand-in that runs one request at
a time with vLLM's --scheduling-policy priority.

NOTE: without it (the control, run beside it), the other tenant's request is answered last, after the six of the
flood: the proxy sent no `priority` of its own, so the worker ran them in arrival order. With it, second, though
the flooding client asks for priority -100 (which the proxy used to pass on, putting itself ahead of everyone).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from support.proxy_fleet import MODEL, start_fleet

ENGINE = {"time_scale": 1.0, "max_num_seqs": 1, "scheduling_policy": "priority", "decode_base_s": 0.02}


async def _order(tmp_path: Path, fair: bool) -> tuple[list[str], list[int]]:
    """Acme sends six requests at once; bravo one once they wait at the worker. Who was answered when, and the
    priorities the worker received."""
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=ENGINE, fair_priority=fair)
    (sim,) = fleet.sims.values()
    done: list[str] = []

    async def ask(who: str, i: int, extra: dict[str, object] | None = None) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{who} question {i}"}], "max_tokens": 8,
                **(extra or {})}
        status, _, raw = await fleet.post("/v1/chat/completions", body, who=who)
        assert status == 200, raw
        done.append(f"{who}{i}")

    try:
        flood = [asyncio.create_task(ask("a", i, {"priority": -100} if fair else None)) for i in range(6)]
        while sim.engine.waiting < 5:   # one runs, five wait at the worker
            await asyncio.sleep(0.01)
        await ask("b", 0)
        await asyncio.gather(*flood)
        sent = [json.loads(raw).get("priority", 0) for _, raw, _ in sim.received.items]
        return done, sent
    finally:
        await fleet.stop()


async def test_another_tenants_request_goes_ahead_of_a_flood(tmp_path: Path) -> None:
    fifo, fifo_sent = await _order(tmp_path / "off", fair=False)
    fair, fair_sent = await _order(tmp_path / "on", fair=True)
    print(f"answered in order, without: {fifo} (priorities sent {fifo_sent}); with: {fair} ({fair_sent})")
    assert fifo.index("b0") == 6               # the control: behind the whole flood
    # after the one already running, and at worst acme's priority-0 request too, had its 1 reached the worker first
    assert fair.index("b0") <= 2
    assert sorted(fair_sent) == [0, 0, 1, 2, 3, 4, 5]   # acme's 0..5 (its own -100 replaced), bravo's 0
    assert fifo_sent == [0] * 7                # without: none sent (vLLM's default, 0)


async def test_a_client_priority_on_a_fcfs_worker_is_refused_as_vllm_refuses_it(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1)
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "priority": 3}
        status, _, raw = await fleet.post("/v1/completions", body)
        assert status == 400 and b"Priority scheduling is not enabled" in raw, raw
        status, _, _ = await fleet.post("/v1/completions", {**body, "priority": 0})
        assert status == 200
    finally:
        await fleet.stop()


def test_a_tenants_numbers_never_fall_while_it_has_requests_in_flight() -> None:
    """A flood's later requests keep their place behind its earlier ones (arrival order within the tenant); a
    tenant with one request at a time, or back from idle, sends 0. NOTE: numbered by the count alone, a request
    sent after two ended got 2 and passed the flood's older one waiting at 3."""
    from controller.proxy.fair import FairPriority

    fair = FairPriority()
    flood = [fair.claim("acme", "w0") for _ in range(4)]
    assert [cm.__enter__() for cm in flood] == [0, 1, 2, 3]
    with fair.claim("bravo", "w0") as b, fair.claim("acme", "w1") as elsewhere:
        assert (b, elsewhere) == (0, 0)
    for cm in flood[:2]:
        cm.__exit__(None, None, None)           # two of acme's four end
    with fair.claim("acme", "w0") as later:
        assert later == 3                       # its peak, not its count (2)
    for cm in flood[2:]:
        cm.__exit__(None, None, None)
    assert fair.busy == {}                      # none in flight: nothing kept
    with fair.claim("acme", "w0") as fresh:
        assert fresh == 0


async def test_a_worker_without_the_priority_policy_loses_the_fairness_not_requests(tmp_path: Path) -> None:
    """--fair-priority in front of a worker left at fcfs (vLLM's default): a tenant's second request in flight
    there carries priority 1, which the worker refuses (400); the proxy sends it again without one, and sends
    that worker none from then on. NOTE: before, that 400 reached the client."""
    engine = {**ENGINE, "scheduling_policy": "fcfs"}
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw=engine, fair_priority=True)
    (name, sim), = fleet.sims.items()
    try:
        body = {"model": MODEL, "prompt": "the same question", "max_tokens": 8, "priority": 7}
        got = await asyncio.gather(*(fleet.post("/v1/completions", {**body, "prompt": f"q{i}"}) for i in range(4)))
        assert [status for status, _, _ in got] == [200] * 4, [raw for _, _, raw in got]
        assert name in fleet.proxy.fair.fcfs
        sent = [json.loads(raw).get("priority") for _, raw, _ in sim.received.items]
        print(f"priorities the fcfs worker received: {sent}")
        # the four at once got 0-3 (the client's 7 never sent); the three refused went again without one
        assert sorted(x for x in sent if x is not None) == [0, 1, 2, 3] and sent.count(None) == 3
        status, _, _ = await fleet.post("/v1/completions", body)
        assert status == 200 and json.loads(sim.received.items[-1][1]).get("priority") is None
    finally:
        await fleet.stop()
