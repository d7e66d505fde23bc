"""Benchmark traces of prompt requests and an online cache simulator (pure: no I/O).

Token ids are fresh integers from a counter, so two spans share a prefix only where the trace
says so. A `Request` is what one call sends (the prompt) plus what the engine then writes into
the cache after it (the model's output); the hit rate counts prompt tokens only.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fleet.core.radix.policies import EvictionPolicy
from fleet.core.radix.tree import RadixTree


@dataclass(frozen=True, slots=True)
class Request:
    prompt: tuple[int, ...]
    output: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SimResult:
    num_queried_tokens: int
    num_hit_tokens: int
    max_cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class _Fresh:
    """Hands out never-seen token ids."""

    def __init__(self) -> None:
        self.next_id = 0

    def __call__(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out


# -- the seeds' four traces -------------------------------------------------------------------

def few_shot(preamble: int = 256, question: int = 16, num_requests: int = 16) -> list[Request]:
    """One shared preamble, then a fresh question per request."""
    fresh = _Fresh()
    pre = fresh(preamble)
    return [Request(pre + fresh(question)) for _ in range(num_requests)]


def multi_turn(first: int = 64, per_turn: int = 32, turns: int = 8) -> list[Request]:
    """Turn t sends the whole history: `first` tokens, then `per_turn` more each later turn."""
    fresh = _Fresh()
    history = fresh(first)
    out = [Request(history)]
    for _ in range(turns - 1):
        history = history + fresh(per_turn)
        out.append(Request(history))
    return out


def tree_of_thought(root: int = 64, thought: int = 16, fan_out: int = 3, depth: int = 3) -> list[Request]:
    """Every root-to-leaf path of a complete thought tree, depth-first (fan_out**depth requests)."""
    fresh = _Fresh()
    paths: list[tuple[int, ...]] = [fresh(root)]
    for _ in range(depth):
        paths = [p + fresh(thought) for p in paths for _ in range(fan_out)]
    return [Request(p) for p in paths]


def agents(num_agents: int = 5, shared: int = 128, steps: int = 6, step_tokens: int = 24) -> list[Request]:
    """Agents over one shared prefix, turn-major: step 1 of every agent, then step 2, ..."""
    fresh = _Fresh()
    prefix = fresh(shared)
    histories = [prefix] * num_agents
    out = []
    for _ in range(steps):
        for a in range(num_agents):
            histories[a] = histories[a] + fresh(step_tokens)
            out.append(Request(histories[a]))
    return out


SEED_TRACES = {"few-shot": few_shot, "multi-turn": multi_turn, "tree-of-thought": tree_of_thought,
               "agents": agents}


# -- realistic traces -------------------------------------------------------------------------

def agent_loop(num_agents: int = 8, turns: int = 12, system: int = 256, seed: int = 0) -> list[Request]:
    """Outputs feed the next request: prompt(t+1) = prompt(t) + output(t) + tool result(t).

    Agents start cold at the same time (turn-major interleaving) over one system prompt.
    """
    rng, fresh = random.Random(seed), _Fresh()
    sys_prompt = fresh(system)
    histories = [sys_prompt + fresh(rng.randint(16, 48)) for _ in range(num_agents)]
    out = []
    for _ in range(turns):
        for a in range(num_agents):
            output = fresh(rng.randint(8, 32))
            out.append(Request(histories[a], output))
            histories[a] = histories[a] + output + fresh(rng.randint(16, 64))
    return out


def edited_chat(num_sessions: int = 6, turns: int = 14, system: int = 192, seed: int = 1,
                edit_every: int = 4) -> list[Request]:
    """Chats whose harness edits history: every `edit_every` turns one earlier message is
    rewritten (a truncated tool result, a compaction summary), so the prefix breaks there."""
    rng, fresh = random.Random(seed), _Fresh()
    sys_prompt = fresh(system)
    msgs: list[list[tuple[int, ...]]] = [[fresh(rng.randint(16, 40))] for _ in range(num_sessions)]
    out = []
    for t in range(turns):
        for s in range(num_sessions):
            if t and t % edit_every == 0 and len(msgs[s]) > 2:
                i = rng.randrange(1, len(msgs[s]) - 1)
                msgs[s][i] = fresh(max(4, len(msgs[s][i]) // 2))
            prompt = sys_prompt + tuple(x for m in msgs[s] for x in m)
            output = fresh(rng.randint(8, 24))
            out.append(Request(prompt, output))
            msgs[s].extend([output, fresh(rng.randint(12, 40))])
    return out


def cold_burst(num_waves: int = 3, sessions_per_wave: int = 10, turns: int = 5, system: int = 320,
               seed: int = 2) -> list[Request]:
    """Waves of sessions that start cold together over a shared system prompt, interleaved with
    the still-running sessions of the previous wave; outputs feed the next turn."""
    rng, fresh = random.Random(seed), _Fresh()
    sys_prompt = fresh(system)
    live: list[list[tuple[int, ...]]] = []
    out = []
    for _ in range(num_waves):
        live = live[-sessions_per_wave // 2:] + [[sys_prompt + fresh(rng.randint(16, 48))]
                                                 for _ in range(sessions_per_wave)]
        for _ in range(turns):
            for h in live:
                output = fresh(rng.randint(8, 32))
                out.append(Request(h[0], output))
                h[0] = h[0] + output + fresh(rng.randint(8, 48))
    return out


REALISTIC_TRACES = {"agent-loop": agent_loop, "edited-chat": edited_chat, "cold-burst": cold_burst}


# -- simulation -------------------------------------------------------------------------------

def simulate(trace: Sequence[Request], capacity_tokens: int | None = None,
             policy: EvictionPolicy | str = "lru", page_size: int = 1) -> SimResult:
    """Serve requests online, in arrival order: match (count), then cache prompt + output.

    The hit of each request is measured before that request changes the cache.
    """
    tree = RadixTree.simulated(page_size=page_size, capacity_tokens=capacity_tokens, policy=policy)
    peak = 0
    for req in trace:
        tree.match_prefix(req.prompt)
        tree.insert(req.prompt + req.output)
        peak = max(peak, tree.num_cached_tokens)
    return SimResult(tree.num_queried_tokens, tree.num_hit_tokens, peak)


def optimal_hits(trace: Sequence[Request]) -> Iterator[int]:
    """Per request, the longest common prefix with anything sent or written before it (brute
    force, independent of the tree): the hit of an unbounded token-granular cache."""
    seen: list[tuple[int, ...]] = []
    for req in trace:
        yield max((_lcp(req.prompt, s) for s in seen), default=0)
        seen.append(req.prompt + req.output)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def longest_request(trace: Sequence[Request]) -> int:
    return max(len(r.prompt) for r in trace)
