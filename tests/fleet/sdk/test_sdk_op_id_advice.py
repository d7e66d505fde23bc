"""An Unavailable session call's error carries its op id and says how to finish it safely, once: where the
controller's message already names the retry (its kernel host did not answer in time, workers/call_timeout.py), the
SDK adds none of its own. NOTE: before, the advice came twice."""

from __future__ import annotations

from fleet.core.errors import InvalidArgument, Unavailable
from fleet.sdk.failures import with_op_id


def test_the_retry_advice_is_given_once() -> None:
    named = with_op_id(Unavailable("session 's1': its kernel host did not answer the append call in time; "
                                   "Retry with op_id 'a1': it is answered from the session's op log"), "a1")
    assert str(named).lower().count("op_id") == 1 and named.op_id == "a1"
    bare = with_op_id(Unavailable("Append: deadline exceeded"), "a1")  # control: a bare one gets the advice
    assert "call again with op_id='a1'" in str(bare) and bare.op_id == "a1"
    other = with_op_id(InvalidArgument("bad piece"), "a1")  # not Unavailable: no advice, the op id still set
    assert "op_id" not in str(other) and other.op_id == "a1"
