"""The stand-in's parts that its routes read: its config, the requests it received, and `Sim`, the view of a
running stand-in (main.SimVllm) that app.py and completions.py take, so they never import main.py."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.engine import SimEngine
from fleet.app.testkit.sim_vllm.loop import EngineLoop
from fleet.app.testkit.sim_vllm.publisher import Publisher


@dataclass(slots=True)
class SimConfig:
    engine: SimEngineConfig = field(default_factory=SimEngineConfig)
    host: str = "127.0.0.1"
    port: int = 0
    kv_events_port: int = 0
    replay_port: int | None = 0
    topic: str = ""
    buffer_steps: int = 10000
    legacy_replay: bool = False
    # the global DP rank this server runs, as vLLM's --data-parallel-rank (external DP load balancing): its PUB and
    # replay bind kv_events_port + dp_rank and replay_port + dp_rank (0: pick), and its batches and /metrics say it
    dp_rank: int = 0


@dataclass(slots=True)
class Received:
    """The last `maxlen` completion (and pooling, responses) requests this stand-in received: (path, raw body,
    prompt text).

    For tests that must show some bytes never reached a worker: `contains` looks in the raw body and in
    the prompt as the model would read it (message contents or the prompt string, JSON escapes undone).
    """

    maxlen: int = 1000
    items: deque[tuple[str, str, str]] = field(default_factory=deque)

    def add(self, path: str, raw: str, body: dict[str, Any]) -> None:
        msgs = body.get("messages")
        if isinstance(msgs, list):
            text = "\n".join(str(m.get("content")) for m in msgs if isinstance(m, dict))
        else:
            text = str(body.get("prompt", body.get("input")))
        self.items.append((path, raw, text))
        while len(self.items) > self.maxlen:
            self.items.popleft()

    def contains(self, needle: str) -> bool:
        return any(needle in raw or needle in text for _, raw, text in self.items)

    def prompts(self) -> list[str]:
        return [text for _, _, text in self.items]


@dataclass(slots=True)
class StoredResponses:
    """/v1/responses answers kept for `previous_response_id`, GET and cancel, as vLLM's API server keeps them (with
    VLLM_ENABLE_RESPONSES_API_STORE) in its memory: a restart loses them. The last `maxlen`."""

    maxlen: int = 1024
    items: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)

    def add(self, response: dict[str, Any]) -> None:
        self.items[response["id"]] = response
        while len(self.items) > self.maxlen:
            self.items.popitem(last=False)


class Sim(Protocol):
    """A running stand-in, as its HTTP routes see it (main.SimVllm is one)."""

    cfg: SimConfig
    engine: SimEngine
    publisher: Publisher | None
    loop: EngineLoop | None
    received: Received
    responses: StoredResponses

    def restart(self) -> None: ...
