"""`session ls`, `worker ls` and `quarantine ls` against a real `kvfleet up`, each run as a user runs it (a process).

Before (found by review): the session dashboard's title said "kvfleet sessions (fleet)" whatever it listed (without
--fleet, a tenant's own sessions); `--json --watch` listed once, as one indented JSON document, and `--count N`
without --watch listed once, both without a word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from support.kvfleet_up import start_up, stop_up

from fleet.sdk import FleetClient

Up = dict[str, str]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    proc, info = start_up(tmp_path_factory.mktemp("up"), "--tenant", "acme")
    try:
        with FleetClient(str(info["controller"]), str(info["tenant_token"])) as c:
            c.create_session("s1", "You are agent zero.")
        yield {k: str(v) for k, v in info.items()}
    finally:
        stop_up(proc)


def _kvfleet(up: Up, *argv: str, token: str = "operator_token") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fleet.app.cli.main", *argv, "--controller", up["controller"], "--token", up[token]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})


@pytest.mark.parametrize(("flags", "token", "title"), [
    (["--fleet"], "operator_token", "kvfleet sessions: every tenant, fleet-wide"),
    ([], "operator_token", "kvfleet sessions: every tenant, the controller's node only"),
    (["--fleet", "--tenant", "acme"], "operator_token", "kvfleet sessions: tenant acme, fleet-wide"),
    (["--fleet"], "tenant_token", "kvfleet sessions: tenant acme (yours), fleet-wide"),
])
def test_the_session_dashboard_says_what_it_lists(up: Up, flags: list[str], token: str, title: str) -> None:
    done = _kvfleet(up, "session", "ls", *flags, token=token)
    print(done.stdout, done.stderr)
    assert done.returncode == 0 and done.stdout.splitlines()[0].strip() == title  # before: "kvfleet sessions (fleet)"
    assert "s1" in done.stdout  # the control: it is the listing, and the session is in it


@pytest.mark.parametrize(("command", "key"), [("session", None), ("worker", "workers"), ("quarantine", None)])
def test_json_watch_prints_one_json_line_per_refresh(up: Up, command: str, key: str | None) -> None:
    done = _kvfleet(up, command, "ls", "--json", "--watch", "--interval", "0.1", "--count", "3")
    print(done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 3  # before: one indented document, many lines, listed once
    docs = [json.loads(line) for line in lines]
    assert all(isinstance(d, dict) and key in d if key else isinstance(d, list) for d in docs)
    if command == "session":
        assert [[r["session_id"] for r in d] for d in docs] == [["s1"]] * 3
    # the control: a plain --json is still one indented document, listed once
    plain = _kvfleet(up, command, "ls", "--json")
    assert plain.returncode == 0 and plain.stdout == json.dumps(docs[-1], indent=1) + "\n"


@pytest.mark.parametrize("flag,value", [("--count", "1"), ("--interval", "0.2")])
@pytest.mark.parametrize("command", ["session", "worker", "quarantine"])
def test_count_or_interval_without_watch_is_a_usage_error(up: Up, command: str, flag: str, value: str) -> None:
    done = _kvfleet(up, command, "ls", flag, value)
    assert done.returncode == 2 and flag in done.stderr and "add --watch" in done.stderr, done  # before: rc 0
    assert done.stdout == "" and "usage:" in done.stderr
    assert _kvfleet(up, command, "ls", "--watch", "--count", "1", flag, value).returncode == 0  # the control
