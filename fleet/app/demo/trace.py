"""The demo's recorded trace: every request sent to a vLLM stand-in, and every lifecycle event,
in the order the workers saw them. The offline model replays it under each routing policy.

    Request(agent="agent-1", turn=7, token_ids=(...), salt="9f..", worker="w0", verdict="WARM",
            claimed_tokens=480, cached_tokens=480, sent_to_sleeping=False)
    Lifecycle(action="sleep", worker="w1", via="controller", level=1)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Request:
    """One request as kvfleet routed it live.

    Attributes:
        token_ids: the whole history of the agent's session at this turn (the prompt).
        salt: the tenant's cache_salt (from the route answer), sent to the worker.
        worker: where kvfleet routed it (and the demo sent it).
        verdict: WARM | COLD, as the controller answered.
        claimed_tokens: tokens the controller said were resident there (0 when COLD).
        cached_tokens: tokens the worker actually reused (its usage.prompt_tokens_details).
        sent_to_sleeping: the worker was asleep when the request was sent (ground truth).
    """

    agent: str
    turn: int
    token_ids: tuple[int, ...]
    salt: str
    worker: str
    verdict: str
    claimed_tokens: int
    cached_tokens: int
    sent_to_sleeping: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """A dormancy action on a worker. via: "controller" (the lifecycle RPC) or "direct" (HTTP
    straight to the worker, behind the controller's back)."""

    action: str  # sleep | wake_up
    worker: str
    via: str
    level: int = 1
    turn: int = 0

    def __post_init__(self) -> None:
        assert self.action in ("sleep", "wake_up") and self.via in ("controller", "direct"), self


Event = Request | Lifecycle


@dataclass(slots=True)
class Trace:
    """The ordered events of one run, plus the workers' cache geometry."""

    workers: list[str]
    block_size: int
    num_blocks: int
    events: list[Event] = field(default_factory=list)

    def requests(self) -> list[Request]:
        return [e for e in self.events if isinstance(e, Request)]

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "block_size": self.block_size, "num_blocks": self.num_blocks,
                "events": [{"type": type(e).__name__, **asdict(e)} for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        t = cls(list(d["workers"]), int(d["block_size"]), int(d["num_blocks"]))
        for e in d["events"]:
            e = dict(e)
            kind = e.pop("type")
            if kind == "Request":
                e["token_ids"] = tuple(e["token_ids"])
                t.events.append(Request(**e))
            else:
                t.events.append(Lifecycle(**e))
        return t
