"""fleet/core/oplog.py: the typed op log, its JSON form, and the helpers every reader uses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fleet.core.errors import AlreadyExists, InvalidArgument
from fleet.core.oplog import (
    AppendOp,
    EvictOp,
    ForkOp,
    QuarantineOp,
    blob_refs,
    call_fingerprint,
    check_op_reuse,
    exact_tokens,
    kv_follows_tokens,
    last_index_of,
    num_tokens,
    own_op_fps,
    own_op_ids,
    parse,
    parse_log,
    to_dict,
)

REF = "ab" * 32
LOG = [
    AppendOp(0, "system", "acme", (1, 2, 3), role="system", op_id="o1"),
    AppendOp(1, "tool_result", "acme", ref=REF, num_tokens=5, op_id="o2"),
    EvictOp(1, 3, 5, "exact", "quarantine", op_id="o3"),
    QuarantineOp(REF, ("instruction_override",), op_id="o3"),
    ForkOp("parent", 4),
    AppendOp(2, "message", "acme", (7, 8), role="user", op_id="o1"),
]


def test_every_op_round_trips_through_the_stores_json() -> None:
    stored = [json.loads(json.dumps(to_dict(op), sort_keys=True)) for op in LOG]  # what the store keeps
    assert parse_log(stored) == LOG
    # the wire form the store held before ops were typed: unchanged, so old logs replay
    assert stored[1] == {"op": "append", "piece": 1, "kind": "tool_result", "ref": REF, "tenant": "acme",
                         "num_tokens": 5, "op_id": "o2"}
    assert stored[4] == {"op": "fork", "parent": "parent", "at": 4}  # no op id: the key is left out
    assert parse({"op": "evict", "piece": 1, "start": 0, "length": 2, "mode": "exact"}).reason == "evict"


@pytest.mark.parametrize("bad", [
    {"op": "rename", "to": "x"},
    {"op": "append", "piece": 0, "kind": "system"},                      # no tenant, no tokens
    {"op": "append", "piece": 0, "kind": "poem", "tenant": "a", "tokens": [1]},
    {"op": "append", "piece": 0, "kind": "tool_result", "tenant": "a", "tokens": [1]},  # a result logs its ref
    {"op": "evict", "piece": 0, "start": 0, "length": 1, "mode": "fast"},
    {"op": "fork", "parent": "p", "at": "seven"},
])
def test_a_malformed_op_is_refused_with_what_is_wrong(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="op log: (malformed|unknown)"):
        parse(bad)


def test_a_malformed_op_is_refused_under_python_o_too() -> None:
    """The kind, ref and mode checks were asserts: `python -O` dropped them, and a stored log with an unknown kind or
    evict mode parsed as if it were well formed. The control runs the same script without -O."""
    import subprocess
    import sys

    bad = [{"op": "append", "piece": 0, "kind": "poem", "tenant": "a", "tokens": [1]},
           {"op": "append", "piece": 0, "kind": "tool_result", "tenant": "a", "tokens": [1]},
           {"op": "evict", "piece": 0, "start": 0, "length": 1, "mode": "fast"}]
    script = ("import sys\nfrom fleet.core.errors import InvalidArgument\nfrom fleet.core.oplog import parse\n"
              f"for d in {bad!r}:\n    try:\n        parse(d)\n    except InvalidArgument as e:\n"
              "        print('refused', e)\n")
    for flags in ([], ["-O"]):
        out = subprocess.run([sys.executable, *flags, "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("refused") == len(bad), (flags, out.stdout)


def test_own_op_ids_stop_at_the_last_fork_marker() -> None:
    assert own_op_ids(LOG) == {"o1"}                      # the parent's o2, o3 are not the child's
    assert own_op_ids(LOG[:4]) == {"o1", "o2", "o3"}      # control: without the marker they are its own
    assert last_index_of(LOG, "o1") == 5 and last_index_of(LOG, "o3") == 3 and last_index_of(LOG, "zz") is None


def test_tokens_refs_and_kv_follow_the_log() -> None:
    assert num_tokens(LOG) == 3 + 5 - 5 + 2
    assert blob_refs(LOG) == [(REF, "acme")]
    assert kv_follows_tokens(LOG)
    assert not kv_follows_tokens([*LOG, EvictOp(0, 0, 3, "reposition")])  # control: a re-rotation
    assert kv_follows_tokens([*LOG, EvictOp(2, 3, 2, "reposition")])  # a tail: no survivor to re-rotate


def test_a_calls_fingerprint_is_logged_with_its_ops_and_old_logs_parse_without_it() -> None:
    fp = call_fingerprint("append_message", [7, 8], "user")
    op = AppendOp(2, "message", "acme", (7, 8), role="user", op_id="o1", op_fp=fp)
    stored = json.loads(json.dumps(to_dict(op)))
    assert stored["op_fp"] == fp and parse(stored) == op
    old = {k: v for k, v in stored.items() if k != "op_fp"}          # a log written before fingerprints
    assert parse(old).op_fp == "" and "op_fp" not in to_dict(parse(old))
    assert own_op_fps([*LOG, op]) == {"o1": fp}
    assert own_op_fps(LOG[:4]) == {"o1": "", "o2": "", "o3": ""}      # unfingerprinted: unchecked


def test_the_fingerprint_is_the_call_not_its_op_id() -> None:
    fp = call_fingerprint("append_message", [7, 8], "user")
    assert fp == call_fingerprint("append_message", (7, 8), "user") == call_fingerprint(
        "append_message", np.array([7, 8]), "user")                   # list, tuple or array: the same ids
    assert call_fingerprint("generate", 4) == call_fingerprint("generate", np.int64(4))
    others = {call_fingerprint("append_message", [7, 9], "user"), call_fingerprint("append_message", [7, 8], "tool"),
              call_fingerprint("append_output", [7, 8]), call_fingerprint("generate", 4),
              call_fingerprint("evict", 1, "exact"), call_fingerprint("evict", 1, "reposition"),
              call_fingerprint("append_message", [78], "user"), call_fingerprint("append_message", "78", "user"),
              call_fingerprint("append_message", [7, 8], "user", None), call_fingerprint("append_message", ["x"], "user")}
    assert len(others | {fp}) == 11                                   # every other call differs
    check_op_reuse("o1", fp, fp)                                        # its retry: answered
    check_op_reuse("o1", "", fp)                                        # an old log's op: not checked
    with pytest.raises(AlreadyExists, match="op_id 'o1' was already used for a different call"):
        check_op_reuse("o1", fp, call_fingerprint("generate", 4))


def test_exact_tokens_read_from_the_log_are_the_kernels() -> None:
    """What a retried evict answers from the log (workers.session_kernel.logged_eviction) says what the kernel
    said: after a reposition with survivors, an exact eviction past its span is not exact; from its start it is."""
    from fleet.core.context import SessionContext
    from fleet.core.kernel import ByteTokenizer, Kernel, ModelConfig
    from workers.session_kernel import logged_eviction

    ctx = SessionContext.new(Kernel.synthetic(ModelConfig.tiny(), seed=0), ByteTokenizer(512))
    for i, text in enumerate(("system prompt", "one message", "a tool result", "two", "three", "four", "five")):
        ctx.add_message("user", text * (i + 1))
    calls = [(1, "reposition"), (3, "exact"), (5, "exact"), (2, "exact"), (4, "reposition"), (0, "exact")]
    for i, (piece, mode) in enumerate(calls):
        ctx.op_id = f"e{i}"
        report = ctx.evict_piece(piece, mode)
        assert exact_tokens(ctx.ops) == ctx.session.num_exact_tokens, (piece, mode)
        assert kv_follows_tokens(ctx.ops) == (ctx.session.num_exact_tokens == len(ctx.session)), (piece, mode)
        logged = logged_eviction(ctx.ops, f"e{i}")
        assert logged is not None and logged.exact == report.exact, (piece, mode, report)
    assert [c.exact for c in (logged_eviction(ctx.ops, f"e{i}") for i in range(6))] == [
        False, False, False, True, False, True]


def test_a_logged_eviction_that_emptied_the_session_claims_no_fresh_logits() -> None:
    """A retried evict answered from the log says what the kernel said of an eviction that left no token: no fresh
    logits (there are none). Control: the tail eviction before it, which left the first piece, re-derived them."""
    from fleet.core.context import SessionContext
    from fleet.core.kernel import ByteTokenizer, Kernel, ModelConfig
    from workers.session_kernel import logged_eviction

    ctx = SessionContext.new(Kernel.synthetic(ModelConfig.tiny(), seed=0), ByteTokenizer(512))
    ctx.add_message("user", "system prompt")
    ctx.add_message("user", "a tool result")
    reports = []
    for i, piece in enumerate((1, 0)):
        ctx.op_id = f"e{i}"
        reports.append(ctx.evict_piece(piece, "exact"))
    assert [r.logits_fresh for r in reports] == [True, False] and len(ctx.session) == 0
    for i, r in enumerate(reports):
        logged = logged_eviction(ctx.ops, f"e{i}")
        assert logged is not None and (logged.tail, logged.exact, logged.logits_fresh) == (r.tail, r.exact, r.logits_fresh)
