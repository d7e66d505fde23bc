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

from fleet.app.testkit.sim_vllm.tokenizer import apply_chat_template

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
    """One conversation. `turns[t]` = (user text, assistant text); `think_s[t]` = pause before turn t.
    `tool_role`: a turn's leading tool result (`tool result N: ...`, up to `\ninstruction:`) is sent as
    its own `role: tool` message before the user's instruction, as agent frameworks send it (the proxy
    judges tool messages; a user message it never judges)."""

    session_id: str
    tenant: str
    system: str | None  # None: no system message (a replayed request is one user message)
    turns: tuple[tuple[str, str], ...]
    think_s: tuple[float, ...]
    tool_role: bool = False

    def __post_init__(self) -> None:
        assert self.turns and len(self.turns) == len(self.think_s), self.session_id

    def messages(self, t: int) -> list[dict[str, str]]:
        """The request of turn t: the whole history, then the new user message."""
        out = [] if self.system is None else [{"role": "system", "content": self.system}]
        for i, (user, assistant) in enumerate(self.turns[:t]):
            out += [*self._user(i, user), {"role": "assistant", "content": assistant}]
        return out + self._user(t, self.turns[t][0])

    def _user(self, t: int, text: str) -> list[dict[str, str]]:
        tool, sep, instruction = text.partition("\ninstruction: ")
        if not (self.tool_role and sep and tool.startswith("tool result")):
            return [{"role": "user", "content": text}]
        return [{"role": "tool", "tool_call_id": f"call-{t}", "content": tool},
                {"role": "user", "content": "instruction: " + instruction}]

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
    # open loop (a replayed trace): (seconds from the start, session index), each session one request;
    # empty: closed loop, every session sends its next turn when the last one answered and it thought
    arrivals: tuple[tuple[float, int], ...] = ()
    # working set in tokens when the sessions do not say it (a trace: its distinct blocks)
    distinct_tokens: int = 0
    scale: str = ""  # how a replayed trace was scaled, for the report

    def __post_init__(self) -> None:
        assert self.num_workers >= 2 and 0 < self.sleep_at < self.wake_at < 1 and 0 < self.reset_at < 1
        assert all(len(self.sessions[i].turns) == 1 for _, i in self.arrivals)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(sorted({s.tenant for s in self.sessions}))

    def working_set_tokens(self) -> int:
        """Sum over sessions of the final history (each session's longest prompt); for a replayed
        trace, its distinct blocks."""
        if self.distinct_tokens:
            return self.distinct_tokens
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
            "sleep_at": self.sleep_at,
            "wake_at": self.wake_at,
            "reset_at": self.reset_at,
            **({"open_loop_s": round(self.arrivals[-1][0], 1)} if self.arrivals else {}),
            **({"scale": self.scale} if self.scale else {}),
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
    tool_role: bool = False,
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
    return Session(sid, tenant, system, tuple(ts), tuple(pauses), tool_role)


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
    tool_role: bool = False,
) -> Workload:
    """Agents sharing their tenant's ~1.5k-token system prompt; starts staggered by think time."""
    rng = random.Random(f"{name}/{seed}")
    systems = [f"tenant {k} operations agent. " + words(rng, system_words) for k in range(tenants)]
    sessions = tuple(
        agent_session(rng, f"{name}-s{i}", f"tenant{i % tenants}", systems[i % tenants], turns, think_s,
                      tool_role=tool_role)
        for i in range(num_agents)
    )
    what = f"{num_agents} agents x {turns} turns over {num_workers} workers"
    if tool_role:
        what += ", tool results as role: tool messages"
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
    """The demo's agents (fleet/app/demo/workload.py): its system prompt, user messages and tool results;
    the model's output is replaced by seeded tokens so that the trace does not depend on a kernel."""
    from fleet.app.demo.workload import SYSTEM_PROMPT, agent_name, tool_result, user_message

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


def few_shot_agents(
    name: str, seed: int, *, num_agents: int, turns: int, num_one_shots: int, think_s: float = 0.1
) -> Workload:
    """Agents (their own system prompt) mixed with one-shot requests that share a few-shot preamble and
    never come back (a classification or extraction endpoint): the one-shots arrive spread over the
    agents' run, each one a new question after the same ~1k-token examples."""
    rng = random.Random(f"{name}/{seed}")
    system = "operations agent. " + words(rng, 1400)
    shots = "answer like these examples. " + words(rng, 1000)
    agents_ = [
        agent_session(rng, f"{name}-a{i}", "tenant0", system, turns, think_s) for i in range(num_agents)
    ]
    span = turns * (think_s + 0.05) * 1.5  # about the agents' run
    one = [
        Session(
            f"{name}-q{i}",
            "tenant0",
            shots,
            (("question: " + words(rng, rng.randint(20, 60)), ""),),
            (round(rng.uniform(0, span), 4),),
        )
        for i in range(num_one_shots)
    ]
    # the working set: the agents' histories, the preamble once, each one-shot's own question
    base = one[0].num_tokens(0) - len(apply_chat_template([{"role": "user", "content": one[0].turns[0][0]}]))
    distinct = sum(a.num_tokens(turns - 1) for a in agents_) + sum(o.num_tokens(0) - base for o in one) + base
    return Workload(
        name,
        f"{num_agents} agents x {turns} turns + {num_one_shots} one-shot requests sharing a ~1k-token "
        "few-shot preamble (never returning), over 4 workers",
        4,
        tuple(agents_ + one),
        distinct_tokens=distinct,
    )


def long_context(
    name: str, seed: int, *, num_sessions: int, turns: int, doc_words: int, think_s: float = 0.1
) -> Workload:
    """Sessions over their own long document (questions about it, short answers): every turn re-sends
    the document; scaled 1:8 (a 4k-token document stands for 32k tokens)."""
    rng = random.Random(f"{name}/{seed}")
    sessions = []
    for i in range(num_sessions):
        doc = f"document {i}. " + words(rng, doc_words)
        ts = tuple(
            ("question: " + words(rng, rng.randint(15, 40)), words(rng, rng.randint(20, 50)))
            for _ in range(turns)
        )
        sessions.append(Session(f"{name}-s{i}", "tenant0", doc, ts, tuple(think(rng, think_s) for _ in ts)))
    return Workload(
        name,
        f"{num_sessions} long-context sessions x {turns} turns over 4 workers, each over its own "
        f"~{doc_words * 12 // 11 // 1000}k-token document (1:8 scale of >= 32k tokens)",
        4,
        tuple(sessions),
        scale="1:8 tokens (a 4k-token document stands for 32k)",
    )


def short_chats(name: str, seed: int, *, num_sessions: int, turns: int, think_s: float = 0.1) -> Workload:
    """Many short chats: a short shared system prompt, a few short turns each."""
    rng = random.Random(f"{name}/{seed}")
    system = "you are a helpful assistant. " + words(rng, 40)
    sessions = []
    for i in range(num_sessions):
        ts = tuple((words(rng, rng.randint(8, 30)), words(rng, rng.randint(15, 45))) for _ in range(turns))
        sessions.append(
            Session(f"{name}-s{i}", "tenant0", system, ts, tuple(think(rng, think_s) for _ in ts))
        )
    return Workload(
        name,
        f"{num_sessions} short chats x {turns} turns (short shared system prompt) over 4 workers",
        4,
        tuple(sessions),
    )


def workload(name: str, seed: int = 0, quick: bool = False, think_s: float = 0.1) -> Workload:
    """The named workload; `quick` shrinks turns and sessions for a short validation run."""
    turns = 6 if quick else 12
    if name == "demo":
        return demo_agents(name, seed, num_agents=5, turns=12 if quick else 30, think_s=think_s)
    if name == "agents16x4":
        return agents(name, seed, num_agents=16, num_workers=4, turns=turns, think_s=think_s)
    if name == "agents-tools":  # agents16x4's traffic with its tool results in role: tool messages
        return agents(name, seed, num_agents=16, num_workers=4, turns=turns, think_s=think_s, tool_role=True)
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
    if name == "fewshot-agents":
        return few_shot_agents(
            name, seed, num_agents=8, turns=turns, num_one_shots=48 if quick else 96, think_s=think_s
        )
    if name == "long-context":
        return long_context(
            name, seed, num_sessions=6, turns=4 if quick else 8, doc_words=3800, think_s=think_s
        )
    if name == "short-chats":
        return short_chats(
            name, seed, num_sessions=32 if quick else 64, turns=3 if quick else 4, think_s=think_s
        )
    if name == "mooncake":
        from mooncake import mooncake

        return mooncake(name, num_requests=300 if quick else 600)
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


WORKLOADS = (
    "demo",
    "agents16x4",
    "agents-tools",
    "agents16x8",
    "tenants2",
    "cold-burst",
    "fewshot-agents",
    "long-context",
    "short-chats",
    "mooncake",
)
