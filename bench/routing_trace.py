"""Deterministic agent traces for the fleet routing bench (bench/fleet_routing.py).

A trace is a set of sessions; each session is a conversation that grows by one turn per request
and re-sends its whole history every time (OpenAI chat messages):

    turn t of session s:  [system, user_0, assistant_0, ..., user_{t-1}, assistant_{t-1}, user_t]

The assistant texts are part of the trace (not the workers' answers), so every router sees the
same prompts, byte for byte, whatever it does. Words are synthetic; the stand-in's tokenizer
counts one token per word or punctuation mark, so "~1.5k tokens" below is measured, not guessed.

    wl = workload("agents16x4", seed=0)          # 16 agents over 4 workers
    wl.num_requests, wl.working_set_tokens()     # the cache sizes are set from the latter
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from fleet.testkit.sim_vllm.tokenizer import apply_chat_template

SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ter",
    "sun",
    "dra",
    "vel",
    "op",
    "rin",
    "qua",
    "zo",
    "ble",
    "nox",
    "pri",
    "ust",
)
CACHES = {
    "ample": 1.25,
    "tight": 0.5,
    "very-tight": 1 / 6,
}  # per-worker cache / working set (see `cache_blocks`)


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation. `turns[t]` = (user text, assistant text); `think_s[t]` = pause before turn t."""

    session_id: str
    tenant: str
    system: str
    turns: tuple[tuple[str, str], ...]
    think_s: tuple[float, ...]

    def __post_init__(self) -> None:
        assert self.turns and len(self.turns) == len(self.think_s), self.session_id

    def messages(self, t: int) -> list[dict[str, str]]:
        """The request of turn t: the whole history, then the new user message."""
        out = [{"role": "system", "content": self.system}]
        for user, assistant in self.turns[:t]:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return out + [{"role": "user", "content": self.turns[t][0]}]

    def num_tokens(self, t: int) -> int:
        return len(apply_chat_template(self.messages(t)))


@dataclass(frozen=True, slots=True)
class Workload:
    """Sessions over `num_workers` workers; lifecycle actions fire when these fractions of the
    trace's requests have been issued: sleep (then wake) one worker, reset one worker's cache."""

    name: str
    description: str
    num_workers: int
    sessions: tuple[Session, ...]
    sleep_at: float = 0.35
    wake_at: float = 0.5
    reset_at: float = 0.7

    def __post_init__(self) -> None:
        assert self.num_workers >= 2 and 0 < self.sleep_at < self.wake_at < 1 and 0 < self.reset_at < 1

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(sorted({s.tenant for s in self.sessions}))

    def working_set_tokens(self) -> int:
        """Sum over sessions of the final history (each session's longest prompt)."""
        return sum(s.num_tokens(len(s.turns) - 1) for s in self.sessions)

    def prompt_tokens(self) -> int:
        return sum(s.num_tokens(t) for s in self.sessions for t in range(len(s.turns)))

    def longest_prompt(self) -> int:
        return max(s.num_tokens(len(s.turns) - 1) for s in self.sessions)

    def cache_blocks(self, size: str, block_size: int) -> int:
        """Per-worker cache: `CACHES[size]` x the working set. "tight" is the brief's "sum of
        histories = 2x one worker's cache"; "very-tight" a third of that."""
        return max(16, round(CACHES[size] * self.working_set_tokens() / block_size))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "workers": self.num_workers,
            "sessions": len(self.sessions),
            "requests": self.num_requests,
            "tenants": list(self.tenants),
            "working_set_tokens": self.working_set_tokens(),
            "longest_prompt": self.longest_prompt(),
        }


def words(rng: random.Random, n: int) -> str:
    """n synthetic words with a comma or full stop every few (each one stand-in token)."""
    out = []
    for i in range(n):
        out.append(rng.choice(SYLLABLES) + rng.choice(SYLLABLES) + str(rng.randrange(100)))
        if i % 11 == 10:
            out.append(rng.choice((",", ".")))
    return " ".join(out)


def think(rng: random.Random, mean_s: float) -> float:
    return round(rng.expovariate(1 / mean_s), 4) if mean_s > 0 else 0.0


def agent_session(
    rng: random.Random,
    sid: str,
    tenant: str,
    system: str,
    turns: int,
    think_s: float,
    first_think_s: float | None = None,
) -> Session:
    """A tool-using agent: each user turn carries the previous tool's result and a new instruction."""
    ts = []
    for t in range(turns):
        tool = f"tool result {t}: " + words(rng, rng.randint(80, 240)) if t else ""
        ts.append(
            (tool + "\ninstruction: " + words(rng, rng.randint(20, 60)), words(rng, rng.randint(30, 90)))
        )
    pauses = [think(rng, think_s) for _ in range(turns)]
    pauses[0] = think(rng, think_s) if first_think_s is None else first_think_s
    return Session(sid, tenant, system, tuple(ts), tuple(pauses))


def agents(
    name: str,
    seed: int,
    *,
    num_agents: int,
    num_workers: int,
    turns: int,
    tenants: int = 1,
    think_s: float = 0.1,
    system_words: int = 1400,
) -> Workload:
    """Agents sharing their tenant's ~1.5k-token system prompt; starts staggered by think time."""
    rng = random.Random(f"{name}/{seed}")
    systems = [f"tenant {k} operations agent. " + words(rng, system_words) for k in range(tenants)]
    sessions = tuple(
        agent_session(rng, f"{name}-s{i}", f"tenant{i % tenants}", systems[i % tenants], turns, think_s)
        for i in range(num_agents)
    )
    what = f"{num_agents} agents x {turns} turns over {num_workers} workers"
    if tenants > 1:
        what += f", {tenants} tenants with different system prompts"
    return Workload(name, what, num_workers, sessions)


def cold_burst(
    name: str, seed: int, *, num_sessions: int, num_workers: int, turns: int, think_s: float = 0.1
) -> Workload:
    """A burst: every session is new and starts at once (shared system prompt, cold everywhere)."""
    rng = random.Random(f"{name}/{seed}")
    system = "burst agent. " + words(rng, 1400)
    sessions = tuple(
        agent_session(rng, f"{name}-s{i}", "tenant0", system, turns, think_s, first_think_s=0.0)
        for i in range(num_sessions)
    )
    return Workload(
        name,
        f"burst of {num_sessions} cold sessions x {turns} turns, all starting at once, over "
        f"{num_workers} workers",
        num_workers,
        sessions,
    )


def demo_agents(name: str, seed: int, *, num_agents: int, turns: int, think_s: float = 0.1) -> Workload:
    """The demo's agents (fleet/demo/workload.py): its system prompt, user messages and tool results;
    the model's output is replaced by seeded tokens so that the trace does not depend on a kernel."""
    from fleet.demo.workload import SYSTEM_PROMPT, agent_name, tool_result, user_message

    rng = random.Random(f"{name}/{seed}")
    sessions = []
    for i in range(num_agents):
        a, ts, prev = agent_name(i), [], ""
        for t in range(turns):
            out = [rng.randrange(100, 150000) for _ in range(4)]
            ts.append((prev + user_message(a, t), " ".join(f"t{x}" for x in out)))
            prev = tool_result(a, t, out).decode()
        sessions.append(
            Session(a, "tenant0", SYSTEM_PROMPT, tuple(ts), tuple(think(rng, think_s) for _ in ts))
        )
    return Workload(
        name,
        f"the first demo's shape: {num_agents} agents x {turns} turns (short shared system prompt) over 3 workers",
        3,
        tuple(sessions),
    )


def workload(name: str, seed: int = 0, quick: bool = False, think_s: float = 0.1) -> Workload:
    """The named workload; `quick` shrinks turns and sessions for a short validation run."""
    turns = 6 if quick else 12
    if name == "demo":
        return demo_agents(name, seed, num_agents=5, turns=12 if quick else 30, think_s=think_s)
    if name == "agents16x4":
        return agents(name, seed, num_agents=16, num_workers=4, turns=turns, think_s=think_s)
    if name == "agents16x8":
        return agents(name, seed, num_agents=16, num_workers=8, turns=turns, think_s=think_s)
    if name == "tenants2":
        return agents(name, seed, num_agents=16, num_workers=4, turns=turns, tenants=2, think_s=think_s)
    if name == "cold-burst":
        return cold_burst(
            name,
            seed,
            num_sessions=24 if quick else 48,
            num_workers=4,
            turns=2 if quick else 3,
            think_s=think_s,
        )
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


WORKLOADS = ("demo", "agents16x4", "agents16x8", "tenants2", "cold-burst")
