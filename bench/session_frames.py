"""How many Python frames of kvfleet's own code one session append runs through (issue #14).

Two processes serve an append: the controller (SessionService -> KernelFleet -> a Ray call) and
the session's actor (KernelActor -> its context -> the kernel). This counts, in each, the Python
'call' events whose file lies under the repo's `fleet/`, `controller/` or `workers/` (the
generated `fleet/api` stubs and the kernel's own math, `fleet/core/kernel`, left out), from the
servicer's entry to the Ray call and from the actor's entry to the kernel's `Session.append`; and
the depth of kvfleet frames on the stack when the kernel is entered (the forwarding chain).

    python bench/session_frames.py

The controller side runs a real SessionServicer over a local Ray cluster; the actor side runs the
KernelActor class in this process (no Ray), so one profiler sees every frame of it.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from frames import Tracer, profile  # bench/frames.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SKIP = ("fleet/api", "fleet/core/kernel")  # generated stubs and the kernel's own math
PROMPT = "You are agent zero. Answer briefly."


def actor_side(tmp: str) -> dict[str, Any]:
    """The session's append entry (KernelActor, or SessionKernel in a host) down to the kernel, in this process."""
    from workers.spec import KernelSpec

    def run(c: Tracer) -> None:
        actor = _session(tmp, KernelSpec(block_size=16))
        loop = asyncio.new_event_loop()
        loop.run_until_complete(_create(actor))
        loop.run_until_complete(_append(actor, " warm", "op-0"))
        hello = _append(actor, " hello", "op-1")  # the coroutine (tokens encoded, for a tree that takes them)
        c.on = True
        loop.run_until_complete(hello)
        c.on = False

    t = Tracer(skip=SKIP, at=("fleet/core/kernel/session.py", "append"))
    profile(t, lambda: run(t))
    return t.take()


def _session(tmp: str, spec: Any) -> Any:
    """The session's own object, whichever this tree has: a KernelActor (one Ray actor per session, before
    issue #29) or a SessionKernel inside a kernel host (built here with the host's parts, no Ray)."""
    url = f"sqlite:///{tmp}/actor.db"
    try:
        from workers.session_actor import KernelActor  # type: ignore[import-not-found]
    except ImportError:
        from fleet.cas import open_store
        from workers.lanes import TenantLanes
        from workers.session_kernel import SessionKernel
        from workers.spec import make_kernel, make_tokenizer

        kernel = make_kernel(spec)
        lanes = TenantLanes(1)
        return SessionKernel("acme", "s1", kernel, make_tokenizer(kernel), open_store(url), lanes.run)
    return KernelActor("acme", "s1", url, spec.to_dict())


async def _create(actor: Any) -> Any:
    """The actor's create, whichever signature this tree's KernelActor has (the script runs on the
    code before and after a refactor)."""
    import inspect

    from fleet.core.kernel.tokenizer import encode_message
    from workers.spec import make_tokenizer

    if "system_prompt" in inspect.signature(actor.create).parameters:
        return await actor.create(PROMPT)
    return await actor.create(encode_message(make_tokenizer(actor.kernel), "system", PROMPT))


def _append(actor: Any, text: str, op_id: str) -> Any:
    """A user message, as this tree's KernelActor takes it: text (encoded in the actor, before issue #30) or the
    tokens the controller encoded once (`append_message`; encoded here, outside the traced window's actor)."""
    from fleet.core.kernel.tokenizer import encode_message
    from workers.spec import make_tokenizer

    if not hasattr(actor, "append_message"):
        return actor.append(text, "user", op_id)
    return actor.append_message(encode_message(make_tokenizer(actor.kernel), "user", text), "user", op_id)


class _Context:
    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: Any, msg: str) -> None:
        raise RuntimeError(f"{code}: {msg}")


def controller_side(tmp: str) -> dict[str, Any]:
    """SessionService.Append (the servicer's entry) down to the Ray call, with a real fleet."""
    import ray

    from controller.auth import Authenticator
    from controller.metrics import Metrics
    from controller.servicers.common import ServiceContext
    from controller.servicers.sessions import SessionServicer
    from fleet.api.kvfleet.v1 import sessions_pb2 as pb
    from fleet.cas import open_store

    url = f"sqlite:///{tmp}/ctl.db"
    ctx = ServiceContext(auth=Authenticator(None, b"secret"), metrics=Metrics(), store=open_store(url), router=None,
                         max_blob_bytes=1 << 20, store_url=url)

    def run(c: Tracer) -> None:
        svc, loop, ctxt = SessionServicer(ctx), asyncio.new_event_loop(), _Context()
        req = pb.CreateSessionRequest(session_id="s1", system_prompt=PROMPT)
        loop.run_until_complete(svc.CreateSession(req, ctxt))
        loop.run_until_complete(svc.Append(pb.AppendRequest(session_id="s1", text=" warm"), ctxt))
        c.on = True
        loop.run_until_complete(svc.Append(pb.AppendRequest(session_id="s1", text=" hello"), ctxt))
        c.on = False
        for task in asyncio.all_tasks(loop):
            task.cancel()

    t = Tracer(skip=SKIP)
    try:
        profile(t, lambda: run(t))
        return t.take()
    finally:
        for fn in ctx.on_stop:
            fn()
        ray.shutdown()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        a = actor_side(tmp)
        c = controller_side(tmp)
    verbose = "-v" in sys.argv
    for name, t in (("controller (servicer -> Ray call)", c), ("session (its kernel object -> kernel)", a)):
        print(f"{name}: {t['calls']} kvfleet frames entered, {t['distinct']} functions")
        if verbose:
            print("  " + "\n  ".join(t["functions"]))
    print(f"actor: kvfleet frames on the stack at the kernel's Session.append: {a['depth_at']}")
    print(f"total: {a['calls'] + c['calls']} kvfleet frames entered, {a['distinct'] + c['distinct']} functions "
          "for one append")


if __name__ == "__main__":
    main()
