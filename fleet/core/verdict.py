"""The verdicts a tool result can carry: one set of names, fleet-wide.

The store records them per blob, admission (fleet.core.quarantine.admit) and the controller's judge
(controller.judge) decide them, the proxy and the CLI show them; the values are what the store and the
wire hold, so they never change.

    UNKNOWN      stored and not judged yet
    CLEAN        judged and let in
    QUARANTINED  judged a prompt injection: evicted from every session that holds it, withheld by the proxy

A span's state inside a session (fleet.core.context: "resident", "evicted", "quarantined", ...) is another
thing: it says where the span's tokens are, not what was decided about its bytes.
"""

from __future__ import annotations

UNKNOWN, CLEAN, QUARANTINED = "UNKNOWN", "CLEAN", "QUARANTINED"
VERDICTS = (UNKNOWN, CLEAN, QUARANTINED)
OPERATOR_NS = "quarantine.operator"  # the store's kv space of operators' verdicts on bytes (SetVerdict): "<sha256>" ->
                                     # {"verdict", "reasons", "at"}, for every tenant (controller/verdicts.py)
