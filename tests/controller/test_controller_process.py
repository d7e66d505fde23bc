"""`kvfleet controller` as a process: what it prints, where /metrics binds, and that SIGTERM stops it
gracefully with its local Ray (sessions started one) gone too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from fleet.app.redis_server import RedisServer
from fleet.sdk import FleetClient

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-Pw-9271"


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, with a password (the shared one has none)."""
    with RedisServer() as srv:
        redis.Redis(port=srv.start().port).config_set("requirepass", PASSWORD)
        yield srv


def _wait_line(proc: subprocess.Popen[str], needle: str, timeout: float = 60) -> str:
    deadline, seen = time.monotonic() + timeout, []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} in the controller's output: {''.join(seen)}")


def _ray_left(tmp: str) -> list[str]:
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if tmp in cmd:
            left.append(f"{p.info['pid']} {cmd[:160]}")
    return left


@pytest.mark.slow
def test_sigterm_stops_gracefully_leaves_no_ray_and_prints_no_password(private_redis: RedisServer) -> None:
    tmp = tempfile.mkdtemp(prefix="kvf-ray-")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_TMPDIR=tmp, PYTHONUNBUFFERED="1")
    env.pop("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)  # the controller must set it itself
    store = f"redis://:{PASSWORD}@127.0.0.1:{private_redis.port}/0"
    proc = subprocess.Popen([sys.executable, "-m", "fleet.app.cli.main", "controller", "--listen", "127.0.0.1:0",
                             "--store", store, "--metrics-port", "0"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = _wait_line(proc, "kvfleet controller listening on")
        print(line)
        address = line.split("listening on ")[1].split(" ")[0]
        mport = int(line.split("metrics on ")[1].split(";")[0].rsplit(":", 1)[1])
        assert PASSWORD not in line and "//***@" in line  # the whole user info goes
        # /metrics binds where the gRPC server does (loopback here), not 0.0.0.0
        binds = {c.laddr.ip for c in psutil.Process(proc.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == mport}
        assert binds == {"127.0.0.1"}, binds
        with FleetClient(address, timeout=120) as c:  # the first session starts a local Ray
            assert c.create_session("s1", "hello").session_id == "s1"
        assert _ray_left(tmp), "no Ray process runs under the test's RAY_TMPDIR: the check would be vacuous"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        print(out[-3000:])
        assert proc.returncode == 0, f"rc {proc.returncode} (-6/134: Ray's failure handler aborted the stop)"
        assert "stopping" in out and PASSWORD not in out
        deadline = time.monotonic() + 15
        while _ray_left(tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ray_left(tmp) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _ray_left(tmp):  # never leave a stray Ray behind, even when the test failed
            psutil.Process(int(p.split()[0])).kill()
        shutil.rmtree(tmp, ignore_errors=True)


def test_metrics_host_follows_listen_unless_given() -> None:
    from controller.main import metrics_host

    assert metrics_host("127.0.0.1:50051", None) == "127.0.0.1"
    assert metrics_host("[::1]:50051", None) == "::1"
    assert metrics_host("0.0.0.0:50051", None) == "0.0.0.0"
    assert metrics_host("127.0.0.1:50051", "0.0.0.0") == "0.0.0.0"


@pytest.mark.parametrize(
    "env, flag",
    [
        ({"KVFLEET_METRICS_PORT": "x"}, "--metrics-port: invalid int value: 'x'"),
        ({"KVFLEET_JUDGE_THREADS": "abc"}, "--judge-threads: invalid int value: 'abc'"),
    ],
)
def test_a_malformed_env_number_is_a_usage_error_naming_the_flag(
    env: dict[str, str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller.main import parse_args

    with pytest.raises(SystemExit):  # int() on the value used to raise while the parser was built: a traceback
        parse_args([], env)
    assert flag in capsys.readouterr().err
    assert parse_args([], {"KVFLEET_METRICS_PORT": "9500"}).metrics_port == 9500  # control
    assert parse_args([], {}).metrics_port == 9400


def test_redact_hides_a_password_holding_at_signs() -> None:
    from urllib.parse import urlparse

    from controller.servicers.fleet import redact

    url = "redis://:p@ss@w0rd@db:6379/0"
    assert urlparse(url).password == "p@ss@w0rd"  # what redis-py will send
    assert redact(url) == "redis://***@db:6379/0"
    assert redact("redis://user:secret@db/0") == "redis://***@db/0"  # a user name is a credential too
    assert redact("redis://db:6379/0") == "redis://db:6379/0" and redact("sqlite:///var/a@b.db") == "sqlite:///var/a@b.db"
