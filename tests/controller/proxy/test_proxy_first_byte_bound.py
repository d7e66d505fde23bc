"""--max-first-byte-wait on a worker that says it is awake: the request ends there with a 504, and is neither sent
to another worker nor counted against the worker. A non-streamed vLLM answer sends no byte until it is complete,
so a long one is silent for its whole decode while the worker works on it.

Real parts: a controller, two clocked sim-vllm workers (time_scale 1: an answer takes its modelled steps) and the
proxy (support/proxy_fleet.py); the bound is 1.2 s here instead of 600 s, the answer about twice that."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from support.proxy_fleet import MODEL, Fleet, served, start_fleet

LONG = {"model": MODEL, "prompt": "Write the long essay on harbour logistics.", "max_tokens": 240}
SHORT = {"model": MODEL, "prompt": "Say hi.", "max_tokens": 2}
BOUND_S = 1.2


def _probes(fleet: Fleet, worker: str) -> list[tuple[str, float]]:
    text = fleet.proxy.metrics.render().decode()
    return [(s.labels["observed"], s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "kvfleet_proxy_sleep_probes_total" and s.labels["worker"] == worker and s.value]


async def test_a_long_non_streamed_answer_on_an_awake_worker_ends_in_504_and_is_not_sent_again(
        tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw={"time_scale": 1.0}, first_byte_timeout_s=0.3,
                              max_first_byte_wait_s=BOUND_S, suspect_s=30.0)
    try:
        t0 = time.monotonic()
        async with fleet.http.post(fleet.sims["w0"].url + "/v1/completions", json=LONG) as r:  # control: it is
            assert r.status == 200  # only slow, and answers in time when asked directly
        direct_s = time.monotonic() - t0
        before = {n: len(served(sim, "/v1/completions")) for n, sim in fleet.sims.items()}
        t0 = time.monotonic()
        status, _, raw = await fleet.post("/v1/completions", LONG)
        took = time.monotonic() - t0
        sent = {n: served(sim, "/v1/completions")[before[n]:] for n, sim in fleet.sims.items()}
        err = json.loads(raw)["error"]
        print(f"direct: {direct_s:.2f} s; through the proxy ({BOUND_S} s bound): {status} after {took:.2f} s, sent "
              f"to {[(n, len(a)) for n, a in sent.items()]}, probes {[_probes(fleet, n) for n in sent]}: "
              f"{err['message']}")
        assert direct_s > 1.5 * BOUND_S  # the answer really needs longer than the bound
        assert status == 504 and err["type"] == "GatewayTimeoutError"  # before: 503 after two bounds
        assert sorted(len(a) for a in sent.values()) == [0, 1]  # before: [1, 1], sent again to the other worker
        (worker, attempts), = ((n, a) for n, a in sent.items() if a)
        assert BOUND_S <= took < 2 * BOUND_S
        assert attempts[0].disconnected  # stopped on the worker, not left running
        assert _probes(fleet, worker) and {seen for seen, _ in _probes(fleet, worker)} == {"awake"}
        assert not any(fleet.proxy.directory.is_suspect(n) for n in fleet.sims)  # before: both suspect
        status, _, raw = await fleet.post("/v1/completions", SHORT, who="b")
        assert status == 200, raw  # before: 503, every worker skipped as suspect
    finally:
        await fleet.stop()
