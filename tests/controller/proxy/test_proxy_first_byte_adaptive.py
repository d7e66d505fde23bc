"""The first /is_sleeping probe comes after twice the worker's recent 90th-percentile first-byte wait (within
[first_byte_min_s, first_byte_timeout_s]), not after a fixed timeout sized for slow prompts: a worker that answers
in milliseconds and then goes silent is asked at once; a worker that is only slower than usual answers "awake"
and keeps the request.

Real parts: a controller, sim-vllm workers and the proxy (support/proxy_fleet.py); the sleep is behind the
controller's back (its reconcile is 30 s), so only the proxy's probe can find it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from support.proxy_fleet import BLOCK, MODEL, Fleet, served, start_fleet, until

from controller.proxy.forward import probe_waits
from controller.proxy.watch import FirstBytes

PROMPT = "Plan the week's deliveries for the northern depot, stop by stop, with times. " * 3
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
TIMEOUT_S = 2.5  # the cap: where the first probe came before, whatever the worker's pace


def test_the_first_wait_is_twice_the_recent_p90_within_floor_and_cap() -> None:
    f = FirstBytes(0.05, 0.25, min_samples=8, window=16)
    assert f.first_wait("w") == 0.25  # nothing seen: the cap
    for _ in range(7):
        f.seen("w", 0.01)
    assert f.first_wait("w") == 0.25  # 7 < min_samples: still the cap
    f.seen("w", 0.01)
    assert f.first_wait("w") == 0.05  # 2 x 0.01 is under the floor
    for _ in range(16):
        f.seen("w", 0.06)
    assert abs(f.first_wait("w") - 0.12) < 1e-9  # the window holds only the last 16: 2 x 0.06
    for x in [0.01] * 14 + [0.2, 0.2]:  # 2 slow of 16: the p90 (15th of 16) is slow
        f.seen("w", x)
    assert f.first_wait("w") == 0.25  # 2 x 0.2 is over the cap
    assert f.first_wait("other") == 0.25  # per worker
    assert FirstBytes(0.3, 0.25).first_wait("w") == 0.25  # a floor over the cap is the cap
    fixed = FirstBytes(0.25, 0.25)
    for _ in range(20):
        fixed.seen("w", 0.001)
    assert fixed.first_wait("w") == 0.25  # floor == cap: the fixed wait of before
    waits = probe_waits(0.25, 0.05)
    assert [next(waits) for _ in range(4)] == [0.05, 0.1, 0.2, 0.4]  # then the usual doubling


def _samples(fleet: Fleet, name: str, worker: str) -> list[tuple[str, float]]:
    text = fleet.proxy.metrics.render().decode()
    return [(next(v for k, v in s.labels.items() if k != "worker"), s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name and s.labels.get("worker") == worker and s.value]


async def _warm_on_one_worker(fleet: Fleet, n: int) -> str:
    """n answers of the same prompt: affinity keeps them on one worker, whose first-byte waits the proxy learns."""
    workers = []
    for _ in range(n):
        status, h, raw = await fleet.post("/v1/completions", BODY)
        assert status == 200, raw
        workers.append(h["x-kvfleet-worker"])
    x = max(set(workers), key=workers.count)
    assert workers.count(x) >= 10, workers
    n_tokens = json.loads(raw)["usage"]["prompt_tokens"]
    await until(lambda: fleet.blocks_known(x), lambda k: k >= n_tokens // BLOCK)
    return x


async def _first_request_after_a_sleep(tmp_path: Path, first_byte_min_s: float) -> tuple[float, dict[str, str],
                                                                                          list[tuple[str, float]]]:
    fleet = await start_fleet(tmp_path, reconcile_s=30.0, first_byte_timeout_s=TIMEOUT_S,
                              first_byte_min_s=first_byte_min_s)
    try:
        x = await _warm_on_one_worker(fleet, 12)
        async with fleet.http.post(fleet.sims[x].url + "/sleep?level=1") as r:  # NOT through the controller
            assert r.status == 200
        before = len(served(fleet.sims[x], "/v1/completions"))
        t0 = time.monotonic()
        status, h, raw = await fleet.post("/v1/completions", BODY)
        took = time.monotonic() - t0
        assert status == 200, raw
        assert len(served(fleet.sims[x], "/v1/completions")) == before + 1  # it really waited on the sleeper
        assert h["x-kvfleet-worker"] != x and h["x-kvfleet-attempts"] == "2"
        return took, h, _samples(fleet, "kvfleet_proxy_sleep_probes_total", x)
    finally:
        await fleet.stop()


async def test_a_fast_worker_gone_silent_is_probed_long_before_the_timeout(tmp_path: Path) -> None:
    took, _, probes = await _first_request_after_a_sleep(tmp_path / "adaptive", first_byte_min_s=0.05)
    # control, same fleet and trace: the first probe at the fixed timeout, as before this change
    took_fixed, _, probes_fixed = await _first_request_after_a_sleep(tmp_path / "fixed", first_byte_min_s=TIMEOUT_S)
    print(f"request to a worker slept behind the controller's back answered elsewhere after {took:.2f} s "
          f"(fixed {TIMEOUT_S} s first wait: {took_fixed:.2f} s); probes {probes} / {probes_fixed}")
    assert probes == [("asleep", 1.0)] and probes_fixed == [("asleep", 1.0)]
    assert took_fixed >= TIMEOUT_S
    assert took < 1.0  # the instant sims answer in milliseconds: 2 x p90 is at the 0.05 s floor


async def test_a_slower_than_usual_answer_is_probed_and_kept(tmp_path: Path) -> None:
    # a clocked worker: the short warm-up prompts take milliseconds, the long one's prefill about 0.6 s
    fleet = await start_fleet(tmp_path, num_workers=1, reconcile_s=30.0, first_byte_timeout_s=TIMEOUT_S,
                              engine_kw={"time_scale": 1.0, "prefill_tokens_per_s": 2000.0})
    try:
        x = await _warm_on_one_worker(fleet, 12)
        first_wait = fleet.proxy.forwarder.first_bytes.first_wait(x)
        long_body = {**BODY, "prompt": "Itemise every parcel on the manifest, with its weight. " * 100}
        t0 = time.monotonic()
        status, h, raw = await fleet.post("/v1/completions", long_body)
        took = time.monotonic() - t0
        assert status == 200, raw
        probes = _samples(fleet, "kvfleet_proxy_sleep_probes_total", x)
        print(f"first probe due {first_wait:.3f} s after a send; a long prompt took {took:.2f} s; probes {probes}")
        assert first_wait < took / 2  # the answer came well after the first probe was due ...
        assert h["x-kvfleet-worker"] == x and h["x-kvfleet-attempts"] == "1"  # ... and stayed: awake means wait
        assert probes and all(seen == "awake" for seen, _ in probes)
        assert not _samples(fleet, "kvfleet_proxy_retries_total", x)
    finally:
        await fleet.stop()
