"""`kvfleet up` as a real process (its own local Ray, embedded store, one stand-in), driven with
the SDK and looked at with `kvfleet session ls --fleet --json` and `kvfleet worker ls --json`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.kvfleet_up import start_up, stop_up

from fleet.app.cli import session as session_cli
from fleet.app.cli import worker as worker_cli
from fleet.sdk import FleetClient


@pytest.mark.slow
def test_up_session_ls_worker_ls(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    proc, info = start_up(tmp_path, "--sim-workers", "1", "--tenant", "acme")
    try:
        addr, op, tok = str(info["controller"]), str(info["operator_token"]), str(info["tenant_token"])
        assert str(info["store"]).startswith("sqlite:///") and (tmp_path / "kvfleet.db").exists()
        with FleetClient(addr, tok) as c:
            c.create_session("s1", "You are agent zero. Answer briefly.")
            c.append("s1", " hello")
        capsys.readouterr()
        assert session_cli.main(["ls", "--fleet", "--json", "--controller", addr, "--token", op]) == 0
        [row] = json.loads(capsys.readouterr().out)
        assert (row["session_id"], row["tenant"], row["num_tokens"], row["state"]) == ("s1", "acme", 41, "active")
        assert row["actor"] == f"host:{row['actor'].split(':')[1]}:{row['node']}" and row["bytes_alone"] > 0 and row["node"]  # its kernel host
        assert session_cli.main(["ls", "--fleet", "--controller", addr, "--token", op]) == 0
        table = capsys.readouterr().out
        assert "s1" in table and "acme" in table and "active / 0" in table
        # --watch re-polls live: a session created while it runs shows up in a later frame
        import threading

        def _create_later() -> None:
            time.sleep(0.6)
            with FleetClient(addr, tok) as c2:
                c2.create_session("s2", "Second agent.")

        # the watch stops as a user stops it, with Ctrl-C, at the poll after the one that drew s2 (not
        # after a fixed 30 polls); --count 30 stays the bound if s2 never shows up
        render, polls = session_cli.render_sessions, {"s2": 0, "all": 0}

        def render_then_ctrl_c(rows: list[Any], *args: Any, **kw: Any) -> Any:
            polls["all"] += 1
            if polls["s2"]:
                raise KeyboardInterrupt
            polls["s2"] = polls["all"] if any(r.session_id == "s2" for r in rows) else 0
            return render(rows, *args, **kw)

        monkeypatch.setattr(session_cli, "render_sessions", render_then_ctrl_c)
        t = threading.Thread(target=_create_later)
        t.start()
        try:
            rc = session_cli.main(["ls", "--fleet", "--watch", "--interval", "0.3", "--count", "30",
                                   "--controller", addr, "--token", op])
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C escaped `session ls --watch` (it must end the watch with exit code 0)")
        finally:
            t.join()
            monkeypatch.undo()
        assert rc == 0
        frames = capsys.readouterr().out
        with capsys.disabled():
            print(f"session ls --watch: {polls['all']} polls, s2 first in poll {polls['s2']}")
        assert polls["s2"] > 1 and "s1" in frames and "s2" in frames   # s2 came in a later frame, not the first
        assert worker_cli.main(["ls", "--watch", "--interval", "0.1", "--count", "2",
                                "--controller", addr, "--token", op]) == 0
        assert "w0" in capsys.readouterr().out
        assert worker_cli.main(["ls", "--json", "--controller", addr, "--token", op]) == 0
        snap = json.loads(capsys.readouterr().out)
        assert [w["name"] for w in snap["workers"]] == ["w0"] and snap["nodes"][0]["num_sessions"] == 2
        # a reader token lists workers but not sessions: the workers are shown, the nodes say why not (before:
        # PermissionDenied, rc 2, no worker shown)
        from controller.auth import mint_token

        reader = mint_token(tmp_path / "tokens.json", "ops", "reader", "watcher")
        assert worker_cli.main(["ls", "--controller", addr, "--token", reader]) == 0
        shown = capsys.readouterr().out
        assert "w0" in shown and "PermissionDenied" in shown
        # a tenant token may not list workers: a clear status, exit code 2
        assert worker_cli.main(["ls", "--controller", addr, "--token", tok]) == 2
        assert "PermissionDenied" in capsys.readouterr().err
        assert session_cli.main(["ls", "--fleet", "--controller", addr, "--token", "kvf_wrong"]) == 2
        assert "Unauthenticated" in capsys.readouterr().err
    finally:
        rc, _, _ = stop_up(proc)
    assert rc == 0


def test_dashboards_show_what_a_controller_answered_as_text() -> None:
    # before: a worker named "w[/]" ended `kvfleet worker ls` with rich's MarkupError, and a session id holding
    # terminal codes set the window title and cleared the screen
    import io

    from rich.console import Console

    from fleet.sdk.types import RankInfo, WorkerInfo

    rank = RankInfo(0, 1, True, "serving", "warm", 10, 5, True, 0.0, 0.0, "")
    workers = [WorkerInfo("w[/]", "http://x:8000", "", "", "[bold]m", 1, 16, "sha256", None, (rank,)),
               WorkerInfo("w2\x1b]0;PWNED\x07\x1b[2J" + "x" * 500, "http://y:8000", "", "", "m", 1, 16, "sha256", None,
                          (rank,))]
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=400).print(worker_cli.render_workers(workers, []))
    text = out.getvalue()
    assert "w[/]" in text and "[bold]m" in text  # shown as sent, not read as markup
    assert "\x07" not in text and "]0;PWNED" not in text.replace("\\x1b]0;PWNED", "")  # codes escaped
    assert "\\x1b]0;PWNED\\x07\\x1b[2J" in text and "x" * 250 not in text  # visible, and the cell clipped


@pytest.mark.parametrize("interval", ["inf", "nan", "0", "-5", "soon"])
def test_a_refresh_interval_must_be_a_finite_positive_number(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    # before: `--interval inf` ended `kvfleet session ls --watch` in an OverflowError
    with pytest.raises(SystemExit) as e:
        session_cli.parse(["ls", "--watch", "--interval", interval])
    assert e.value.code == 2 and "argument --interval" in capsys.readouterr().err
    assert session_cli.parse(["ls", "--watch", "--interval", "0.5"]).interval == 0.5  # the control


async def test_a_signal_while_the_fleet_starts_stops_the_start() -> None:
    # before: `kvfleet up` installed its signal handlers after start_stack returned: Ctrl-C during a slow start
    # (ray.init) did nothing
    import asyncio

    from fleet.app.cli import up as up_cli

    cancelled = asyncio.Event()

    async def slow_start() -> Any:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    assert await asyncio.wait_for(up_cli._start_unless_stopped(slow_start(), stop), 5) is None
    assert cancelled.is_set()

    async def quick_start() -> str:  # control: a start that ends first is returned
        return "stack"

    assert await up_cli._start_unless_stopped(quick_start(), asyncio.Event()) == "stack"  # type: ignore[arg-type]
