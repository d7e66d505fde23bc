"""Local references: the same ops replayed in this process, to compare digests and logits with."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from fleet.core.context import SessionContext
from fleet.core.oplog import parse_log
from workers.spec import KernelSpec, make_kernel, make_tokenizer

SPEC = KernelSpec(block_size=16)


def replay_locally(ops: list[dict[str, Any]], store: Any = None, tenant: str = "default") -> SessionContext:
    kernel = make_kernel(SPEC)
    return SessionContext.replay(parse_log(ops), kernel, make_tokenizer(kernel), lambda ref: store.get(ref, tenant), tenant)


def prefilled(system_prompt: str) -> SessionContext:
    """A session that prefilled its system prompt itself (no adopted blocks)."""
    kernel = make_kernel(SPEC)
    ctx = SessionContext.new(kernel, make_tokenizer(kernel))
    ctx.add_system(system_prompt)
    return ctx


def wait_dead(actor: Any, timeout_s: float = 60.0) -> None:
    """Block until Ray reports the actor dead (kills and owner deaths are processed asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the actor is still alive")


def host_of(store_url: str, node_id: str) -> Any:
    """The kernel host (Ray actor) of `node_id` in the fleet on `store_url`."""
    from workers.placement import RAY_NAMESPACE, fleet_scope, host_name

    return ray.get_actor(host_name(node_id, fleet_scope(store_url)), namespace=RAY_NAMESPACE)


def kill_host(store_url: str, node_id: str) -> None:
    """Kill a node's kernel host, as a crash would (Ray restarts it empty: every session it held is
    lost, each rebuilt from its op log on its next call), and wait until the new one answers."""
    host = host_of(store_url, node_id)
    pid = ray.get(host.stats.remote(), timeout=60)["pid"]
    ray.kill(host, no_restart=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ray.get(host.stats.remote(), timeout=5)["pid"] != pid:
                return
        except ray.exceptions.RayActorError:
            pass
        time.sleep(0.05)
    raise AssertionError("the host was not restarted")


def run_scenario(script: Path, tmp: Path, timeout_s: float = 400) -> dict[str, Any]:
    """Run a scenario script (`python SCRIPT OUT.json`: its own Ray, in its own process) and return its
    result; fails the test with the script's stderr when it wrote nothing, or with its traceback."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import pytest

    root = Path(__file__).resolve().parents[2]
    out = tmp / f"{script.stem}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # NOTE: its own session (process group): past the timeout the whole group is killed, the Ray it started
    # included; subprocess.run's timeout killed the script alone and its Ray's agents lived on
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env={**env, "PYTHONPATH": str(root)}, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the scenario ran past {timeout_s} s:\n{stderr[-3000:]}")
    if not out.exists():
        pytest.fail(f"the scenario wrote nothing (rc {proc.returncode}):\n{stderr[-3000:]}")
    r: dict[str, Any] = json.loads(out.read_text())
    assert "error" not in r, r["error"]
    return r


def scenario_result(out: Path, scenario: Any) -> None:
    """A scenario script's end: `scenario(tmp_dir)`'s result, or its traceback as {"error": ...}, as JSON in `out`
    (the test that ran the script, `run_scenario`, fails with it)."""
    import json
    import tempfile
    import traceback

    with tempfile.TemporaryDirectory() as d:
        try:
            result = scenario(Path(d))
        except Exception:  # noqa: BLE001 - reported to the test, which prints it
            result = {"error": traceback.format_exc()}
    out.write_text(json.dumps(result))


def together(n: int, call: Callable[[int], Any], at_once: bool = True) -> dict[int, Any]:
    """`call(i)` for i in range(n), each on its own thread, all released at once by a barrier (at_once=False: one
    after another, the control); i -> its result."""
    if not at_once:
        return {i: call(i) for i in range(n)}
    out: dict[int, Any] = {}
    go = threading.Barrier(n)
    threads = [threading.Thread(target=lambda i=i: (go.wait(), out.__setitem__(i, call(i)))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
