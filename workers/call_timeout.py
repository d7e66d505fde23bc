"""What a session call whose kernel host did not answer in time tells its caller (KernelFleet._call, fork).

A host call past `call_timeout_s` raises CallTimeout ("a worker did not answer within Ns"): it names neither the
session nor what to do. The host may still run the call: a mutating verb's op may be applied after its caller
stopped waiting, and its op id makes the retry safe (an op id already in the session's log is answered from it,
`replayed`, never applied twice); a read changed nothing. Other errors keep their own, more specific message
(SessionTorn, a rebuild that outlasted its call, NotFound): only CallTimeout is reworded here.
"""

from __future__ import annotations

from fleet.core.errors import Unavailable
from workers.nodes import CallTimeout

# SessionKernel methods -> the verb a caller named; the mutating ones take the op id as their last argument
MUTATING = {"append_message": "append", "append_output": "append", "add_tool_result": "append",
            "generate": "generate", "evict": "evict", "admit_tool_result": "admit_tool_result"}
READS = {"info": "info", "digest": "info", "tokens": "info", "pieces": "info", "last_logits": "info", "snapshot": "info",
         "working_set": "working_set", "fork_point": "fork"}


def session_timeout(session_id: str, method: str, args: tuple[object, ...], e: CallTimeout) -> Unavailable:
    """The Unavailable a caller of `method` (a SessionKernel method, with `args`) on session `session_id` gets when
    its host did not answer (`e`): the session and verb named, whether the op may have been applied, what to do.
    A mutating verb's error carries its op id (`op_id`)."""
    verb = MUTATING.get(method) or READS.get(method, method)
    head = f"session {session_id!r}: its kernel host did not answer the {verb} call in time ({e})"
    if method not in MUTATING:
        err = Unavailable(f"{head}; it changed nothing: retry the call (the host may be busy with this session's "
                          "earlier calls or a long rebuild)")
        return err
    op_id = str(args[-1]) if args else ""
    how = (" (an evict retried without it is refused FAILED_PRECONDITION 'piece N is evicted' if it was applied)"
           if verb == "evict" else "")
    err = Unavailable(f"{head}; the host may still apply it: the op may have been applied. Retry with op_id "
                      f"{op_id!r}: it is answered from the session's op log (replayed=true), never applied twice{how}")
    err.op_id = op_id
    return err


def fork_timeout(session_id: str, child_id: str, e: CallTimeout) -> Unavailable:
    """A fork whose child's host did not answer: the fork was not acknowledged and what it made was removed."""
    return Unavailable(f"session {session_id!r}: its fork into {child_id!r} was not answered by the child's kernel "
                       f"host in time ({e}); no session {child_id!r} was created (what the fork made was removed): "
                       "retry the fork")
