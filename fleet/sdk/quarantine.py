"""Quarantine calls of the SDK (QuarantineService): typed results and the request builders of the quarantine rows of
the table (fleet/sdk/table.py), which FleetClient and AsyncFleetClient run.

    with FleetClient("127.0.0.1:50051", token=tok) as c:
        j = c.judge_tool_results([b"tool output", "more output"])   # Judgements(judgements, detector_config_id)
        c.list_quarantines(limit=20)                                # [QuarantineRecord, ...], most recent first
        op.set_verdict(j.judgements[0].ref, "QUARANTINED", reasons=["pii"])   # an operator token

A verdict is on a tool result's bytes, named by their SHA-256 (hex, `ref`), as the proxy's x-kvfleet-quarantined
header names them (docs/quarantine.md). All three are retried on UNAVAILABLE: a verdict is the same when asked
again and setting one twice sets it once; a judge retried after a lost answer may count a quarantined result's
`num_seen` twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleet.api.kvfleet.v1 import quarantine_pb2 as pb
from fleet.core.errors import InvalidArgument
from fleet.sdk import args

MAX_LIMIT = 1000  # rows one ListQuarantines answers at most (controller/servicers/quarantine.py)


@dataclass(frozen=True, slots=True)
class Judgement:
    """The verdict on one tool result. `source`: "detector" | "operator" | "blob" (the tenant's blob of these
    bytes is quarantined)."""

    ref: str
    quarantined: bool
    reasons: tuple[str, ...]
    source: str


@dataclass(frozen=True, slots=True)
class Judgements:
    """One per tool result, in order, and the detector configuration the detector's verdicts were made under."""

    judgements: tuple[Judgement, ...]
    detector_config_id: str


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    """A tool result quarantined for a tenant. `action`: "placeholder" | "refuse" (judged) | "evict" (a session's
    admit_tool_result) | "late" (a heavy detector layer's verdict, after the answer); times are unix seconds."""

    tenant: str
    ref: str
    reasons: tuple[str, ...]
    source: str
    action: str
    first_seen: float
    last_seen: float
    num_seen: int


@dataclass(frozen=True, slots=True)
class OperatorVerdict:
    """The verdict an operator set on `ref` ("" when dropped)."""

    ref: str
    verdict: str


# -- proto -> types ---------------------------------------------------------------------------

def judgements(r: pb.JudgeToolResultsResponse) -> Judgements:
    return Judgements(tuple(Judgement(j.ref, j.quarantined, tuple(j.reasons), j.source) for j in r.judgements),
                      r.detector_config_id)


def records(r: pb.ListQuarantinesResponse) -> list[QuarantineRecord]:
    return [QuarantineRecord(x.tenant, x.ref, tuple(x.reasons), x.source, x.action, x.first_seen, x.last_seen,
                             x.num_seen) for x in r.records]


def operator_verdict(r: pb.SetVerdictResponse) -> OperatorVerdict:
    return OperatorVerdict(r.ref, r.verdict)


def _result(value: object) -> bytes:
    if isinstance(value, str):
        return args.text("a tool result", value).encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise InvalidArgument(f"each tool result must be bytes or str, got {type(value).__name__}")


# -- request builders: the quarantine calls' signatures (fleet/sdk/table.py) -------------------------

def judge_tool_results(results: Sequence[bytes | str], *, action: str = "placeholder") -> pb.JudgeToolResultsRequest:
    """The controller's verdict on each tool result (its bytes; a str is sent as UTF-8), as the proxy asks for
    it: at most 256 per call. A quarantined one is recorded for the token's tenant with `action` ("placeholder"
    or "refuse": what the caller does with it)."""
    if isinstance(results, str | bytes | bytearray | memoryview):
        raise InvalidArgument("judge_tool_results takes a list of tool results, not one")
    return pb.JudgeToolResultsRequest(results=[_result(x) for x in results], action=args.text("action", action))


def set_verdict(ref: object, verdict: str, *, reasons: Sequence[str] | None = None) -> pb.SetVerdictRequest:
    """Operator: a verdict on a tool result's bytes by their SHA-256 `ref`, fleet-wide. "QUARANTINED" or
    "CLEAN" overrides the detector for every later request that carries them, in every tenant; "" drops it."""
    return pb.SetVerdictRequest(ref=args.ref(ref), verdict=args.text("verdict", verdict),
                                reasons=args.strings("reasons", reasons))


def list_quarantines(*, tenant: str = "", limit: int = 100) -> pb.ListQuarantinesRequest:
    """Recently quarantined tool results, most recent first: the token's tenant's; an operator's token: `tenant`'s,
    or every tenant's with tenant="". At most `limit` (1 to 1000) rows."""
    return pb.ListQuarantinesRequest(tenant=args.text("tenant", tenant), limit=args.count("limit", limit, 1, MAX_LIMIT))
