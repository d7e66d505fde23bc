"""The live run: agents on kernel sessions (through the controller), requests routed by the
controller to vLLM stand-ins, mid-run fork / quarantine / sleeps; everything recorded in a Trace.

A round is turn-major: every active agent's kernel work (message, greedy output, tool result in
the CAS, admission) runs concurrently, then its request is routed and sent, agent by agent, so
the trace order is the order the workers saw.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from fleet.app.demo.trace import Lifecycle, Request, Trace
from fleet.app.demo.workload import POISON, DemoConfig, agent_name, tool_result, user_message
from fleet.app.testkit.stack import MODEL, Stack
from fleet.core.errors import FailedPrecondition
from fleet.core.verdict import QUARANTINED

SEND_TIMEOUT_S = 2.0  # a request to a sleeping vLLM hangs: give up, count it, route again


@dataclass(slots=True)
class Agent:
    """Client-side view of an agent: its resident pieces, in order (the request is their tokens)."""

    name: str
    pieces: list[tuple[int | None, tuple[int, ...]]] = field(default_factory=list)
    until: int | None = None  # branches close after this round

    def history(self) -> list[int]:
        return [t for _, toks in self.pieces for t in toks]


@dataclass(slots=True)
class LiveResult:
    trace: Trace
    quarantine: dict[str, Any]
    fork: dict[str, Any]
    lifecycle: list[dict[str, Any]]
    sent_to_sleeping: int
    num_rounds: int
    wall_s: float


Progress = Callable[[str, int], None]  # (message, requests done so far)


class LiveRun:
    def __init__(self, cfg: DemoConfig, stack: Stack, progress: Progress | None = None) -> None:
        self.cfg, self.stack, self.c = cfg, stack, stack.client
        self.progress = progress or (lambda msg, n: None)
        self.trace = Trace(list(stack.sims), cfg.block_size, cfg.num_blocks)
        self.agents: list[Agent] = []
        self.quarantine: dict[str, Any] = {}
        self.fork_info: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.sent_to_sleeping = 0
        self.served: dict[str, int] = {}
        self._slept = self._direct = ""
        self._http: aiohttp.ClientSession | None = None

    # -- the run ------------------------------------------------------------------------------

    async def run(self) -> LiveResult:
        t0 = time.monotonic()
        self._http = aiohttp.ClientSession()
        try:
            await self._create_agents()
            sch = self.cfg.schedule
            for t in range(self.cfg.turns):
                await self._events_before(t, sch)
                active = [a for a in self.agents if a.until is None or t < a.until]
                await asyncio.gather(*(self._kernel_turn(a, t) for a in active))
                for a in active:
                    await self._request(a, t)
                await self._close_finished(t)
            await self._check_histories()
        finally:
            await self._http.close()
        return LiveResult(self.trace, self.quarantine, self.fork_info, self.events, self.sent_to_sleeping,
                          self.cfg.turns, time.monotonic() - t0)

    async def _create_agents(self) -> None:
        from fleet.app.demo.workload import SYSTEM_PROMPT

        names = [agent_name(i) for i in range(self.cfg.agents)]
        rows = [await self.c.create_session(names[0], SYSTEM_PROMPT)]   # the others adopt its prefix blocks
        rows += await asyncio.gather(*(self.c.create_session(n, SYSTEM_PROMPT) for n in names[1:]))
        for n in names:
            st = await self.c.get_session(n, include_tokens=True)
            self.agents.append(Agent(n, [(0, st.token_ids)]))
        self.progress(f"{len(rows)} agent sessions up (shared system prompt)", 0)

    async def _kernel_turn(self, a: Agent, t: int) -> None:
        r = await self.c.append(a.name, user_message(a.name, t))
        a.pieces.append((r.piece.piece_id, r.piece.token_ids))          # type: ignore[union-attr]
        out = await self.c.generate(a.name, self.cfg.output_tokens)
        a.pieces.append((None, tuple(out)))
        poisoned = t == self.cfg.schedule.poison and a.name == agent_name(1)
        ref = await self.c.put_blob(POISON if poisoned else tool_result(a.name, t, out))
        r = await self.c.add_tool_result(a.name, ref)
        a.pieces.append((r.piece.piece_id, r.piece.token_ids))          # type: ignore[union-attr]
        adm = await self.c.admit_tool_result(a.name, ref)
        if adm.verdict == QUARANTINED:
            a.pieces = [p for p in a.pieces if p[0] != r.piece.piece_id]  # type: ignore[union-attr]
            self._record_quarantine(a, t, str(ref), adm)
        elif poisoned:
            raise FailedPrecondition("the poisoned tool result was not quarantined by the detector")

    def _record_quarantine(self, a: Agent, t: int, ref: str, adm: Any) -> None:
        w = adm.witness
        self.quarantine = {"agent": a.name, "turn": t, "ref": ref, "reasons": list(adm.reasons),
                           "evicted": adm.evicted, "write_time": w.write_time if w else None,
                           "tokens": w.length if w else 0, "max_abs_delta": w.max_abs_delta if w else None,
                           "control": w.control if w else None, "exact": w.exact if w else None}
        self._event(f"quarantined {a.name}'s poisoned tool result: max|Δ| = {self.quarantine['max_abs_delta']}, "
                    f"control {self.quarantine['control']:.3g}", t)

    async def _request(self, a: Agent, t: int) -> None:
        ids = a.history()
        for _ in range(3):
            d = await self.c.route(ids, MODEL, probe=True)
            asleep = self.stack.sims[d.worker].engine.is_sleeping()   # ground truth, for the count
            usage = await self._send(d.url, ids, d.cache_salt)
            if usage is None:
                self.sent_to_sleeping += 1
                continue
            cached = int(usage["prompt_tokens_details"]["cached_tokens"])
            claimed = d.matched_tokens if d.warm else 0
            self.trace.events.append(Request(a.name, t, tuple(ids), d.cache_salt, d.worker, d.verdict, claimed,
                                             cached, asleep))
            self.served[d.worker] = self.served.get(d.worker, 0) + 1
            self.progress("", len(self.trace.requests()))
            return
        raise FailedPrecondition(f"{a.name} turn {t}: three routes in a row went to a sleeping worker")

    async def _send(self, url: str, ids: list[int], salt: str) -> dict[str, Any] | None:
        assert self._http is not None
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "cache_salt": salt}
        try:
            async with self._http.post(f"{url}/v1/completions", json=body,
                                       timeout=aiohttp.ClientTimeout(total=SEND_TIMEOUT_S)) as resp:
                resp.raise_for_status()
                return dict((await resp.json())["usage"])
        except TimeoutError:
            return None

    # -- mid-run events -----------------------------------------------------------------------

    async def _events_before(self, t: int, sch: Any) -> None:
        if t == sch.fork:
            await self._fork(t)
        if t == sch.sleep:
            self._slept = self._busiest()
            w = await self.stack.admin.lifecycle(self._slept, "sleep", level=1)
            self._lifecycle("sleep", self._slept, "controller", t, f"epoch {w.epoch}, kv {w.kv}")
        if t == sch.wake:
            w = await self.stack.admin.lifecycle(self._slept, "wake_up")
            self._lifecycle("wake_up", self._slept, "controller", t, f"epoch {w.epoch}, kv {w.kv}")
        if t == sch.direct_sleep:
            self._direct = self._busiest()
            await self._direct_call(self._direct, "/sleep?level=1")
            self._lifecycle("sleep", self._direct, "direct", t, "HTTP straight to the worker")
        if t == sch.direct_wake:
            await self._direct_call(self._direct, "/wake_up")
            self._lifecycle("wake_up", self._direct, "direct", t, "HTTP straight to the worker")

    def _busiest(self) -> str:
        """The awake worker that served the most requests (ties: the larger name); the offline
        model aims each policy's sleeps with the same rule (fleet.app.demo.model.busiest)."""
        names = [n for n in self.stack.sims if not self.stack.sims[n].engine.is_sleeping()]
        return max(names, key=lambda n: (self.served.get(n, 0), n))

    async def _direct_call(self, worker: str, path: str) -> None:
        assert self._http is not None
        async with self._http.post(self.stack.sims[worker].url + path) as resp:
            resp.raise_for_status()

    def _lifecycle(self, action: str, worker: str, via: str, t: int, note: str) -> None:
        self.trace.events.append(Lifecycle(action, worker, via, 1, t))
        self._event(f"{action} {worker} via {via} ({note})", t)

    def _event(self, msg: str, t: int) -> None:
        self.events.append({"turn": t, "event": msg})
        self.progress(f"turn {t}: {msg}", len(self.trace.requests()))

    async def _fork(self, t: int) -> None:
        parent = self.agents[0]
        kids = [f"{parent.name}.b{k + 1}" for k in range(self.cfg.branches)]
        rows = await asyncio.gather(*(self.c.fork(parent.name, k) for k in kids))
        for k in kids:
            self.agents.append(Agent(k, list(parent.pieces), until=t + self.cfg.branch_turns))
        self.fork_info = {"parent": parent.name, "branches": kids, "turn": t,
                          "prefix_tokens": len(parent.history()), "branch_turns": self.cfg.branch_turns,
                          "bytes_shared": [r.bytes_shared for r in rows]}
        self._event(f"fork {parent.name} into {', '.join(kids)} at {len(parent.history())} tokens", t)

    async def _close_finished(self, t: int) -> None:
        done = [a for a in self.agents if a.until is not None and a.until == t + 1]
        for a in done:
            await self.c.close_session(a.name)
        if done:
            self._event(f"branches {', '.join(a.name for a in done)} closed", t)

    async def _check_histories(self) -> None:
        """The client's view of each history must be the session's own token list."""
        for a in self.agents:
            if a.until is not None:
                continue
            st = await self.c.get_session(a.name, include_tokens=True)
            if list(st.token_ids) != a.history():
                raise FailedPrecondition(f"{a.name}: the demo's history diverged from its kernel session's")
