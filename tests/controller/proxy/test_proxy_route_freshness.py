"""The route the controller answers is fresher than the proxy's worker listing (polled every --refresh), and the
controller must know where a request runs before it routes the next one (issue #27).

- A worker back in routing after a verb is the controller's choice at once, while the listing still says it is
  not serving: the proxy sends there. Before, it skipped it ("not_serving") for up to --refresh and sent the
  request to a runner-up: a cold request to a busy worker's cache instead of the empty one, a warm one cold.
- When the proxy does skip the chosen worker (its own finding: suspect) the controller hears of the move when
  the request is sent, not at its first byte. Before, a runner-up's prefill ran unseen by the controller's
  block-pool shadow for its whole duration, and routes decided meanwhile trusted blocks it was evicting
  (stale WARM routes in agents16x4 / very-tight through the controller)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from support.proxy_fleet import BLOCK, MODEL, start_fleet, until

from controller.proxy.config import ProxyConfig
from controller.proxy.directory import WorkerDirectory
from fleet.sdk.types import RankInfo, WorkerInfo

PROMPT = "Summarise the quarterly report for the board, section by section, with numbers. " * 3


async def test_the_controllers_choice_is_sent_to_while_the_listing_lags(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, refresh_s=60.0)  # the listing moves only when told here
    try:
        status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert status == 200, raw
        x = h["x-kvfleet-worker"]
        n = json.loads(raw)["usage"]["prompt_tokens"]
        await until(lambda: fleet.blocks_known(x), lambda k: k >= n // BLOCK)
        await fleet.op.lifecycle(x, "pause", mode="keep", clear_cache=False)  # out of routing, cache kept
        await fleet.proxy.directory.refresh()  # the proxy's listing sees x not serving
        await fleet.op.lifecycle(x, "resume")  # back in routing; the listing is not refreshed
        assert not fleet.proxy.directory.serving(x)  # control: the listing lags
        got = [await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
               for _ in range(3)]
        print("after the resume, with the listing lagging:",
              [(h["x-kvfleet-worker"], h["x-kvfleet-verdict"]) for _, h, _ in got])
        assert all(s == 200 and h["x-kvfleet-worker"] == x and h["x-kvfleet-verdict"] == "WARM" for s, h, _ in got)
        assert all(h["x-kvfleet-attempts"] == "1" for _, h, _ in got)
    finally:
        await fleet.stop()


async def test_a_skipped_route_moves_in_the_controller_when_it_is_sent(tmp_path: Path) -> None:
    # a clocked, slow prefill: a cold first byte comes about 1.5 s after the send
    fleet = await start_fleet(tmp_path, num_workers=2, engine_kw={"time_scale": 1.0, "prefill_tokens_per_s": 100.0})
    router = fleet.ctl.ctx.need_router()
    try:
        status, h, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
        assert status == 200, raw
        chosen = h["x-kvfleet-worker"]  # warm there: the controller's choice for the same prompt
        other = next(n for n in fleet.sims if n != chosen)
        n = json.loads(raw)["usage"]["prompt_tokens"]
        await until(lambda: fleet.blocks_known(chosen), lambda k: k >= n // BLOCK)
        fleet.proxy.directory.suspect(chosen)  # the proxy's own finding: it skips the controller's choice
        task = asyncio.create_task(fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}))
        await until(lambda: _loads(router, fleet.sims), lambda ls: sum(ls.values()) == 1, timeout=5.0)
        await asyncio.sleep(0.3)  # a MoveRoute sent at the first byte would not have arrived yet either
        loads = await _loads(router, fleet.sims)
        assert not task.done()  # control: still before the first byte (the cold prefill takes about 1.5 s)
        print("the controller's in-flight ledger before the first byte:", loads)
        assert loads == {chosen: 0, other: 1}
        status, h, raw = await task
        assert status == 200 and h["x-kvfleet-worker"] == other, raw
        assert h["x-kvfleet-verdict"] == "COLD"  # the runner-up's own verdict
    finally:
        await fleet.stop()


async def _loads(router, sims) -> dict[str, int]:  # noqa: ANN001
    return {name: router.flights.load((name, 0))[0] for name in sims}


def test_a_mark_keeps_the_epoch_its_failed_attempt_was_routed_under() -> None:
    """The proxy's listing may lag the controller by an epoch: a worker found asleep is marked with the newest
    epoch the proxy knew of it, so a route decided under that epoch (the controller has not seen the sleep)
    is still skipped, and only one decided under a newer epoch (the controller saw it sleep and wake) clears
    the mark. Marked with the listing's older epoch alone, the next route would have cleared it and been
    sent to the sleeper."""
    d = WorkerDirectory(ProxyConfig(controller="127.0.0.1:1", token="t"), None, None)  # type: ignore[arg-type]
    d.workers["x"] = WorkerInfo("x", "http://x", "", "", "m", 1, 16, "sha256", None,
                                (RankInfo(0, 4, True, "awake", "warm", 10, 0, True, 0.0, 0.0, ""),))
    d.suspect("x", routed_epoch=5)  # the listing says 4; the failed attempt was routed under 5
    assert d.is_suspect("x", routed_epoch=5)
    assert not d.is_suspect("x", routed_epoch=6)
    d.suspect("x")  # no route epoch: the listing's
    assert not d.is_suspect("x", routed_epoch=5)
