"""Ctrl-C on a one-shot command (`session ls`, `worker ls`, `quarantine ls` and `set`, plain or --json) exits 130, as
a shell reports a command that SIGINT ended, with no traceback; Ctrl-C is how `--watch` ends, so it exits 0 there.
Before, the one-shot listings exited 0 on Ctrl-C, as if they had listed everything (found by review)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

COMMANDS = {"session ls": ["session", "ls", "--fleet"], "worker ls": ["worker", "ls"],
            "quarantine ls": ["quarantine", "ls"], "session ls --json": ["session", "ls", "--json"],
            "quarantine set": ["quarantine", "set", "ab" * 32, "CLEAN"]}


class _Held(grpc.GenericRpcHandler):
    """Every call is held until the test lets it go (a controller that has not answered yet); `called` is set."""

    def __init__(self) -> None:
        self.called, self.release = threading.Event(), threading.Event()

    def service(self, details: Any) -> grpc.RpcMethodHandler:
        def hold(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.called.set()
            self.release.wait(60)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

        return grpc.unary_unary_rpc_method_handler(hold)


@pytest.fixture
def held() -> Iterator[tuple[str, _Held]]:
    """A gRPC server on loopback that holds every call: a command run against it is inside its call."""
    handler, server = _Held(), grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", handler
    finally:
        handler.release.set()
        server.stop(0)


def _ctrl_c_during_the_call(argv: list[str], held: tuple[str, _Held]) -> subprocess.CompletedProcess[str]:
    addr, handler = held
    proc = subprocess.Popen([sys.executable, "-m", "fleet.app.cli.main", *argv, "--controller", addr],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "KVFLEET_TOKEN": "kvf_x", "COLUMNS": "200"})
    try:
        assert handler.called.wait(120), "the command never called the controller"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_ctrl_c_on_a_one_shot_command_exits_130(name: str, held: tuple[str, _Held]) -> None:
    r = _ctrl_c_during_the_call(COMMANDS[name], held)
    print(f"kvfleet {name}, Ctrl-C in its call: rc {r.returncode}, stderr {r.stderr!r}")
    assert r.returncode == 130 and "Traceback" not in r.stderr  # before: rc 0


def test_ctrl_c_ends_a_watch_with_0(held: tuple[str, _Held]) -> None:
    # Ctrl-C is how a --watch dashboard ends ("refresh live until Ctrl-C"): a normal end, exit 0
    r = _ctrl_c_during_the_call(["session", "ls", "--fleet", "--watch"], held)
    print(f"kvfleet session ls --watch, Ctrl-C: rc {r.returncode}, stderr {r.stderr!r}")
    assert r.returncode == 0 and "Traceback" not in r.stderr
