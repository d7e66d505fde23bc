"""The test/bench redis-server removes the temp data dir it made, and only that one."""

from __future__ import annotations

import os
from pathlib import Path

import redis

from fleet.app.redis_server import RedisServer


def test_close_removes_the_temp_dir_it_made_with_its_aof() -> None:
    with RedisServer() as srv:
        redis.Redis.from_url(srv.start().url).set("k", b"x" * 4096)
        aof = [p for p in Path(srv.dir).rglob("*") if p.is_file()]
        assert aof, "the AOF is written in the server's dir"  # control: the dir really held data
    assert not os.path.exists(srv.dir)


def test_close_keeps_a_dir_the_caller_named(tmp_path: Path) -> None:
    srv = RedisServer(dir=str(tmp_path)).start()
    redis.Redis.from_url(srv.url).set("k", b"v")
    srv.close()
    assert srv.proc is None
    assert any(p.is_file() for p in tmp_path.rglob("*"))  # the AOF is still there


def test_kill_then_start_keeps_the_data_until_close() -> None:
    with RedisServer() as srv:
        r = redis.Redis.from_url(srv.start().url)
        r.set("k", b"v")
        srv.kill()
        srv.start()
        assert r.get("k") == b"v"


def test_the_server_does_not_outlive_an_owner_killed_before_close(tmp_path: Path) -> None:
    """SIGKILL of the process that started it (no close(), no finally): the server goes with it. Before, it
    stayed, re-parented to init and listening, with its data dir."""
    import signal
    import subprocess
    import sys
    import time

    owner = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom fleet.app.redis_server import RedisServer\n"
         f"s = RedisServer(dir={str(tmp_path)!r}).start()\nprint(s.proc.pid, flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    os.kill(pid, 0)  # control: the server runs while its owner does
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("redis-server outlived its owner")
