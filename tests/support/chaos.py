"""Lifecycle chaos driver: sim workers, random actions and routes, an oracle from /sim/cache.

Stale warm route = a WARM verdict for a worker that is not serving, or whose TRUE cache (as
/sim/cache reports it at route time) lacks the matched prefix. Hit rate = tokens the router's
verdicts correctly claimed / tokens the best serving worker truly held (the oracle).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.baseline import BaselineRouter
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.block_hash import HashConfig, external_chain
from fleet.core.errors import KvfleetError, Unavailable

B = 16
VERBS_THROUGH = ["sleep", "wake_up", "pause", "resume", "reset_prefix_cache", "restart", "drop"]
VERBS_BEHIND = ["sleep", "wake_up", "pause", "resume", "restart", "drop"]
VERBS_INVISIBLE = ["reset_prefix_cache", "pause_clear_resume"]


@dataclass
class Tally:
    routes: int = 0
    warm: int = 0
    stale: int = 0
    stale_not_serving: int = 0
    claimed_ok: int = 0
    oracle: int = 0
    unavailable: int = 0

    def hit_rate(self) -> float:
        return self.claimed_ok / self.oracle if self.oracle else 1.0


HTTP_TIMEOUT_S = 20.0


@dataclass
class Result:
    router: Tally = field(default_factory=Tally)
    baseline: Tally = field(default_factory=Tally)
    actions: dict[str, int] = field(default_factory=dict)
    detect_ms: list[float] = field(default_factory=list)
    detect_kind: list[str] = field(default_factory=list)
    undetected: int = 0
    reverted: int = 0
    restarts_of_controller: int = 0
    rebuilt: tuple[dict[str, Any], dict[str, Any]] | None = None
    errors: list[str] = field(default_factory=list)
    stale_why: list[str] = field(default_factory=list)  # what the router had seen at each of its stale routes


class Chaos:
    def __init__(self, *, seed: int, mode: str, probe: bool = False, n_workers: int = 3, num_blocks: int = 256,
                 reconcile_s: float = 0.2, restart_controller_at: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.mode, self.probe, self.n = mode, probe, n_workers
        self.num_blocks, self.reconcile_s, self.restart_at = num_blocks, reconcile_s, restart_controller_at
        self.res = Result()
        self.debug = False
        self.sims: list[SimVllm] = []
        self.specs: list[WorkerSpec] = []
        self.sessions: list[tuple[str, list[int]]] = []
        self._pending: list[tuple[float, str, int, str]] = []
        self._sent: dict[str, int] = {}  # worker -> seq of the last batch its PUB really sent (drops left out)
        self._acted: dict[str, tuple[str, float]] = {}  # worker -> its last action, when (monotonic)
        self._unsettled: set[str] = set()  # workers whose last _settle ran out

    async def __aenter__(self) -> Chaos:
        self.tmp = tempfile.TemporaryDirectory()
        self.store = open_store(f"sqlite:///{self.tmp.name}/kv.db")
        # NOTE: bounded: a stand-in that never answers must show as an error, not hang the suite
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))
        for _ in range(self.n):
            self.sims.append(await SimVllm(SimConfig(engine=SimEngineConfig(
                model="m", block_size=B, num_blocks=self.num_blocks))).start())
        self.router = await self._new_router()
        self.baseline = BaselineRouter(HashConfig("sha256", None, B))
        for i, s in enumerate(self.sims):
            spec = WorkerSpec(f"w{i}", s.url, s.kv_events, s.replay, "m", block_size=B)
            self.specs.append(spec)
            await self.router.register_worker(spec)
            self.baseline.add_worker(spec.name, s.kv_events)
            self._track_sent(spec.name, s)
        await asyncio.sleep(0.2)  # SUB sockets join
        for k in range(9):
            self.sessions.append((f"tenant-{k % 2}", [self.rng.randrange(100, 150000) for _ in range(40)]))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.router.stop()
        await self.baseline.stop()
        for s in self.sims:
            await s.stop()
        await self.http.close()
        self.store.close()
        self.tmp.cleanup()

    def _track_sent(self, name: str, sim: SimVllm) -> None:
        """Note the seq of each batch the sim's PUB really sends (a `drop` action's batches are not sent)."""
        pub = sim.publisher
        assert pub is not None
        publish = pub.publish

        def tracked(events: list[Any]) -> int:
            dropped = pub.drop_next > 0
            seq = publish(events)
            if not dropped:
                self._sent[name] = seq
            return seq

        pub.publish = tracked  # type: ignore[method-assign]

    async def _new_router(self) -> Router:
        r = Router(self.store, Metrics(), RouterConfig(reconcile_interval_s=self.reconcile_s, probe_on_route=self.probe))
        await r.start()
        return r

    # ---- oracle
    async def truth(self) -> dict[str, dict[str, Any]]:
        out = {}
        for spec in self.specs:
            async with self.http.get(spec.url + "/sim/cache") as r:
                out[spec.name] = await r.json()
        return out

    # ---- one route
    async def route_once(self) -> None:
        k = self.rng.randrange(len(self.sessions))
        salt, toks = self.sessions[k]
        if len(toks) > 320:  # a new conversation
            toks = [self.rng.randrange(100, 150000) for _ in range(40)]
        toks = toks + [self.rng.randrange(100, 150000) for _ in range(self.rng.randrange(8, 40))]
        seen = {s.name: (self.router.worker(s.name).ranks[0].seq, p.seq - 1) for s, p in
                zip(self.specs, (sim.publisher for sim in self.sims), strict=True) if p is not None}
        # each process's publisher counts from 0: with its restarts, (read, published) (0, 0) may be two processes'
        lives = {s.name: (self.router.worker(s.name).ranks[0], self.router.index.num_blocks((s.name, 0)), sim.engine)
                 for s, sim in zip(self.specs, self.sims, strict=True)}
        t_route = time.monotonic()
        try:
            d = await self.router.route(toks, "m", cache_salt=salt)
        except Unavailable:
            self.res.router.unavailable += 1
            await asyncio.sleep(0.02)  # a client backs off and retries on UNAVAILABLE
            return
        bd = self.baseline.route(toks, cache_salt=salt)
        truth = await self.truth()
        hashes = external_chain(HashConfig("sha256", None, B), toks, cache_salt=salt)

        def true_match(name: str) -> int:
            s = set(truth[name]["block_hashes"])
            n = 0
            while n < len(hashes) and hashes[n] in s:
                n += 1
            return n * B

        best = max((true_match(n) for n, t in truth.items() if t["serving"]), default=0)
        if self.debug and d.matched_tokens < best:
            bw = max((n for n, t in truth.items() if t["serving"]), key=true_match)
            print("MISS", best, "best", bw, "router", d.worker, d.verdict, d.matched_tokens,
                  "idx-on-best", self.router.index.match((bw, 0), hashes) * B, self.router.worker(bw).ranks[0],
                  "cands", d.candidates)
        for tally, worker, verdict, matched in ((self.res.router, d.worker, d.verdict, d.matched_tokens),
                                                (self.res.baseline, bd.worker, bd.verdict, bd.matched_tokens)):
            tally.routes += 1
            tally.oracle += best
            serving = truth[worker]["serving"]
            if verdict == "WARM":
                tally.warm += 1
                if not serving or true_match(worker) < matched:
                    if tally is self.res.router:  # NOTE: said when the test fails (a stale route on a loaded machine)
                        act = self._acted.get(worker, ("none", t_route))
                        st, num_indexed, eng = lives[worker]
                        self.res.stale_why.append(
                            f"{worker}: WARM {matched} tokens, truly {true_match(worker)}, serving {serving}; (read, "
                            f"published) seq {seen[worker]}; last action {act[0]} {t_route - act[1]:.3f}s before; "
                            f"settle ran out for {sorted(self._unsettled)}; before the route the router's rank had "
                            f"epoch {st.epoch} fence {st.fence!r} start time {st.start_time} and {num_indexed} blocks "
                            f"indexed, the stand-in's process started {eng.start_time} (restart {eng.generation}) and "
                            f"holds {len(truth[worker]['block_hashes'])}")
                    tally.stale += 1
                    tally.stale_not_serving += int(not serving)
                else:
                    tally.claimed_ok += matched
        if truth[d.worker]["serving"]:
            sim = self.sims[int(d.worker[1:])]
            try:
                async with self.http.post(d.url + "/v1/completions",
                                          json={"prompt": toks, "max_tokens": 8, "cache_salt": salt,
                                                "extra_args": {"kv_cache_report_mode": "full"}}) as r:
                    await r.read()
            except TimeoutError:
                self.res.errors.append(f"completion on {d.worker} got no answer in {HTTP_TIMEOUT_S}s")
                return
            if r.status == 200:
                out = [100 + (i * 7919 + len(toks)) % 150000 for i in range(8)]
                self.sessions[k] = (salt, toks + out)
            await self._settle(d.worker, sim)
        else:
            self.sessions[k] = (salt, toks)  # NOTE: not sent: a request to a sleeping vLLM hangs

    async def _settle(self, name: str, sim: SimVllm, timeout: float = 0.25) -> None:
        """Wait until both routers have seen every batch the sim published (the next turn comes later):
        kvfleet's router every one (it repairs a dropped batch from the replay socket), the baseline every
        one the PUB really sent (it has no repair: waiting for a dropped batch would only run out the timeout)."""
        assert sim.publisher is not None
        want = sim.publisher.seq - 1
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            st = self.router.worker(name).ranks[0]
            if st.seq >= want and self.baseline.seq.get(name, -1) >= min(want, self._sent.get(name, -1)):
                self._unsettled.discard(name)
                return
            await asyncio.sleep(0.002)
        self._unsettled.add(name)

    # ---- one action
    async def act(self) -> None:
        i = self.rng.randrange(self.n)
        name, sim = self.specs[i].name, self.sims[i]
        verbs = {"through": VERBS_THROUGH, "behind": VERBS_BEHIND, "invisible": VERBS_INVISIBLE}[self.mode]
        verb = self.rng.choice(verbs)
        if sim.engine.is_sleeping() and self.rng.random() < 0.7:  # a dormant worker is mostly woken next
            verb = "resume" if sim.engine.paused_by == "pause" else "wake_up"
        elif not sim.engine.is_sleeping() and verb in ("wake_up", "resume"):  # no-op verbs on awake workers
            verb = self.rng.choice([v for v in verbs if v not in ("wake_up", "resume")])
        kw = self._params(verb)
        self.res.actions[verb] = self.res.actions.get(verb, 0) + 1
        self._acted[name] = (verb, time.monotonic())
        if verb == "drop":
            await self.http.post(sim.url + f"/sim/drop_next_events?n={self.rng.randint(1, 3)}")
        elif verb == "restart":
            await self._restart(i)
        elif self.mode == "through":
            try:
                await self.router.lifecycle(name, verb, **kw)
            except KvfleetError as e:
                self.res.errors.append(f"{verb}: {e}")
        else:
            await self._behind(i, verb, kw)

    def _params(self, verb: str) -> dict[str, Any]:
        r = self.rng
        if verb == "sleep":
            return {"level": r.choice([0, 1, 1, 2])}
        if verb == "wake_up":
            return {"tags": r.choice([None, None, ["weights"]])}
        if verb == "pause":
            return {"mode": r.choice(["abort", "keep"]), "clear_cache": r.choice([True, False])} \
                if self.mode == "through" else {"mode": "keep", "clear_cache": False}
        return {}

    async def _restart(self, i: int) -> None:
        spec, sim = self.specs[i], self.sims[i]
        if self.mode == "through":  # an orchestrated restart: the operator deregisters, restarts, registers
            await self.router.unregister_worker(spec.name)
            sim.restart()
            await self.router.register_worker(spec)
        else:
            epoch = self.router.worker(spec.name).ranks[0].epoch
            await self.http.post(sim.url + "/sim/restart")
            self._pending.append((time.monotonic(), spec.name, epoch, "restart"))

    async def _behind(self, i: int, verb: str, kw: dict[str, Any]) -> None:
        spec, sim = self.specs[i], self.sims[i]
        st = self.router.worker(spec.name).ranks[0]
        q: list[tuple[str, str]] = []
        for k, v in kw.items():
            for x in (v if isinstance(v, list) else [] if v is None else [v]):
                q.append((k, str(x).lower()))
        if verb == "pause_clear_resume":
            await self.http.post(sim.url + "/pause", params=[("clear_cache", "true")])
            await self.http.post(sim.url + "/resume")
            return
        async with self.http.post(sim.url + "/" + verb, params=q) as r:
            await r.read()
        if verb in ("sleep", "pause") and st.serving:
            self._pending.append((time.monotonic(), spec.name, st.epoch, verb))

    async def watch_detection(self) -> None:
        """Background: when does the router notice a behind-the-back sleep/pause/restart?"""
        while True:
            now = time.monotonic()
            for p in list(self._pending):
                t0, name, epoch, kind = p
                st = self.router.worker(name).ranks[0]
                if st.epoch != epoch or not st.serving:
                    self.res.detect_ms.append((now - t0) * 1000)
                    self.res.detect_kind.append(p[3])
                    self._pending.remove(p)
                elif not self.sims[int(name[1:])].engine.is_sleeping() and kind != "restart":
                    self.res.reverted += 1  # undone behind its back before any look: nothing to detect
                    self._pending.remove(p)
                elif now - t0 > 5:
                    self.res.undetected += 1
                    self._pending.remove(p)
            await asyncio.sleep(0.002)

    async def run(self, steps: int, p_action: float = 0.2) -> Result:
        watcher = asyncio.create_task(self.watch_detection())
        try:
            for step in range(steps):
                if self.restart_at is not None and step == self.restart_at:
                    before = {s.name: (s.epoch, s.num_blocks) for s in self.router.workers()}
                    crashed = self.store.kv_scan("epochs")  # what a crash leaves: nothing persisted on the way out
                    await self.router.stop()
                    for k, v in crashed.items():
                        self.store.kv_put("epochs", k, v)  # undo the graceful stop's last writes
                    self.router = await self._new_router()  # empty index: rebuilt by replay from the store's seqs
                    self.res.rebuilt = (before, {s.name: (s.epoch, s.num_blocks) for s in self.router.workers()})
                    self.res.restarts_of_controller += 1
                if self.rng.random() < p_action:
                    await self.act()
                else:
                    await self.route_once()
        finally:
            watcher.cancel()
        return self.res


def run_chaos(steps: int, kw: dict[str, Any]) -> Result:
    """One run, `Chaos(**kw)` for `steps` steps, in an event loop of its own (a process pool's task: the
    runs are independent and CPU-bound, so a test can run them side by side, one per core)."""

    async def go() -> Result:
        async with Chaos(**kw) as c:
            return await c.run(steps)

    return asyncio.run(go())

