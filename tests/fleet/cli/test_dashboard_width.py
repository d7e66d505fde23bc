"""The dashboards printed into a pipe (`| less`, `kubectl exec` without -t) keep every cell whole: rich takes 80
columns where stdout is not a terminal and cut the url, model and phase to "htt…" (found by review)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

URL = "http://vllm-worker-0.vllm.llm.svc.cluster.local:8000"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SESSION = "agent-session-0123456789abcdef-planner"

FAKE = f'''
import sys
from types import SimpleNamespace as NS
import fleet.sdk
rank = NS(dp_rank=0, serving=True, warm=True, phase="serving", kv="preserved", epoch=3, num_blocks=1234, last_seq=99,
          load=0.5)
worker = NS(name="vllm-worker-0", url="{URL}", model="{MODEL}", ranks=[rank])
row = NS(session_id="{SESSION}", tenant="acme-research", node="0123456789abcdef", actor="host:kvfleet:0123",
             backend="numpy", device="cpu", num_tokens=123456, history_tokens=100000, bytes_alone=1 << 30,
             bytes_shared=1 << 29, hit_rate=0.5, quarantined_spans=2, state="regenerated", epoch=7, last_active=0.0)
class Client:
    def __init__(self, *a, **kw): pass
    def __enter__(self): return self
    def __exit__(self, *a): return False
    def workers(self): return [worker]
    def fleet_sessions(self, fleet): return NS(nodes=[])
    def sessions(self, fleet, tenant): return [row]
    def whoami(self): return NS(tenant="ops", role="operator", name="ops-admin")
fleet.sdk.FleetClient = Client
from fleet.app.cli import session as session_cli, worker as worker_cli
sys.exit({{"worker": worker_cli, "session": session_cli}}[sys.argv[1]].main(["ls", *sys.argv[2:]]))
'''


@pytest.mark.parametrize(("command", "whole"), [("worker", [URL, MODEL, "serving", "preserved"]),
                                                ("session", [SESSION, "acme-research", "regenerated / 7"])])
def test_a_dashboard_into_a_pipe_keeps_every_cell_whole(command: str, whole: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    args = [command] + (["--fleet"] if command == "session" else [])
    r = subprocess.run([sys.executable, "-c", FAKE, *args], capture_output=True, text=True, timeout=60, env=env)
    print(r.stdout, r.stderr)
    assert r.returncode == 0
    assert [w for w in whole if w not in r.stdout] == [] and "…" not in r.stdout
    # Control: at 80 columns (what a pipe got) the same table does not fit.
    assert max(len(line) for line in r.stdout.splitlines()) > 80


def _row(**kw: object) -> object:
    from types import SimpleNamespace as NS

    base = dict(session_id=SESSION, tenant="acme-research", node="0123456789abcdef", actor="host:kvfleet:0123",
                backend="numpy", device="cpu", num_tokens=1234567, history_tokens=1000000, bytes_alone=3 << 30,
                bytes_shared=(1 << 29) + (1 << 20), hit_rate=0.4567, quarantined_spans=12, state="regenerated",
                epoch=17, last_active=1000.0)
    return NS(**{**base, **kw})


NUMBERS = ["1,234,567", "1,000,000", "3.0 GiB", "513.0 MiB", "45.7%", "12", "17", "100s ago"]


def _session_ls(width: int) -> str:
    """`session ls --fleet` of two sessions, drawn at `width` columns."""
    import io

    from rich.console import Console

    from fleet.app.cli.session import render_sessions

    out = io.StringIO()
    rows = [_row(), _row(session_id="s2", tenant="t", state="active", epoch=0)]
    Console(file=out, width=width, force_terminal=True, color_system=None).print(
        render_sessions(rows, now=1100.0, width=width))
    print(out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("width", [200, 80, 60])
def test_session_ls_at_a_narrow_terminal_keeps_every_number_whole(width: int) -> None:
    # before: at 80 columns the numbers were squeezed to "1,23…" (found by review)
    text = _session_ls(width)
    assert [n for n in NUMBERS if n not in text] == [] and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    assert ("/ host:kvfleet" in text) == (width >= 200)  # node / host: shown only where there is room


def test_a_piped_watch_is_as_wide_as_it_needs() -> None:
    # before: --watch into a pipe used rich's 80 columns, not show()'s rule, and cut cells
    import io

    from rich.console import Console

    from fleet.app.cli.ls_modes import watch
    from fleet.app.cli.session import render_sessions, width_of

    out = io.StringIO()
    console = Console(file=out, width=80)  # a pipe: not a terminal
    watch(console, lambda: render_sessions([_row()], now=1100.0, width=width_of(console)), 0.1, count=1)
    text = out.getvalue()
    assert SESSION in text and "/ host:kvfleet" in text and [n for n in NUMBERS[:6] if n not in text] == []
    assert max(len(line) for line in text.splitlines()) > 80


WORKER_NUMBERS = ["123456", "1,234,567", "9876543", "12.5", "9,999,999", "12,345,678", "2,345,678", "45.7%"]


def _worker_ls(width: int) -> str:
    """`worker ls` of one worker and one kernel node, drawn at `width` columns."""
    import io
    from types import SimpleNamespace as NS

    from rich.console import Console

    from fleet.app.cli.worker import render_workers

    rank = NS(dp_rank=0, serving=True, warm=True, phase="serving", kv="preserved", epoch=123456, num_blocks=1234567,
              last_seq=9876543, load=12.5)
    worker = NS(name="vllm-worker-0", url=URL, model=MODEL, ranks=[rank])
    node = NS(node="0123456789abcdef", num_sessions=12, cached_tokens=1234567, capacity_tokens=9999999,
              queried_tokens=12345678, hit_tokens=2345678, evicted_blocks=123456, hit_rate=0.4567)
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=True, color_system=None).print(
        render_workers([worker], [node], width=width))
    print(out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("width", [200, 100, 80])
def test_worker_ls_at_a_narrow_terminal_keeps_every_number_whole(width: int) -> None:
    # before: at 80 columns every cell was squeezed, numbers to "123…" and "1,2…" (found by review)
    text = _worker_ls(width)
    assert [n for n in WORKER_NUMBERS if n not in text] == [] and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    assert (URL in text) == (width >= 200)  # the url (then the model) is left out where there is no room


def test_worker_ls_at_80_columns_shows_why_the_nodes_are_not_listed_whole() -> None:
    # found by review: the reason was a row of a table whose number columns never wrap, and was cut at 80 columns
    import io

    from rich.console import Console

    from fleet.app.cli.worker import render_workers

    why = "Unavailable: could not reach Ray at 10.0.0.7:6379 within 5 s; check --ray-address and the head node"
    out = io.StringIO()
    Console(file=out, width=80, force_terminal=True, color_system=None).print(render_workers([], [], why, width=80))
    assert why in " ".join(out.getvalue().split())


def _unfolded(text: str) -> str:
    """The text without its white space: a value a record folds onto more lines is whole again (the lines after
    the first are blank in the field column)."""
    return "".join(text.split())


@pytest.mark.parametrize("width", [52, 40, 30])
def test_session_ls_below_the_folded_layout_shows_records_with_nothing_cut(width: int) -> None:
    # before: at 40 columns the session ids, tenants and states were gone and the numbers cut to "1,234,56"
    text = _session_ls(width)
    assert [n for n in NUMBERS if n not in text] == [] and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for whole in (SESSION, "acme-research", "regenerated/17", "s2", "active/0", "01234567/host:kvfleet"):
        assert f"{whole}" in _unfolded(text), whole
    # control: at 80 columns the same rows stay one table (a record per session only where no table fits)
    assert "┃" in _session_ls(80) and "┃" not in text


@pytest.mark.parametrize("width", [50, 30])
def test_worker_ls_below_its_narrowest_table_shows_records_with_nothing_cut(width: int) -> None:
    text = _worker_ls(width)
    assert [n for n in WORKER_NUMBERS if n not in text] == [] and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    assert f"url{URL}model{MODEL}" in _unfolded(text)
    import io

    from rich.console import Console

    from fleet.app.cli.worker import render_workers

    why = "Unavailable: could not reach Ray at 10.0.0.7:6379 within 5 s"
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=True, color_system=None).print(render_workers([], [], why, width=width))
    assert why in " ".join(out.getvalue().split()) and "(none registered)" in out.getvalue()
