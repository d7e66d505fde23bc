"""Common mistakes on the command line get one sentence naming the flag and exit 2, never a traceback or a silent
success (a review of the CLI found each of these; what they did before is beside each case)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.core.errors import InvalidArgument


def test_kvfleet_with_no_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.app.cli.main import main

    assert main([]) == 2                                   # before: the help, and exit 0
    assert "usage: kvfleet" in capsys.readouterr().err


def test_up_with_a_state_dir_it_cannot_make(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.app.cli.up import main

    (tmp_path / "f").write_text("a file")
    assert main(["--state-dir", str(tmp_path / "f"), "--listen", "127.0.0.1:0"]) == 2   # before: FileExistsError
    assert "--state-dir" in capsys.readouterr().err


def test_ports_out_of_range_are_refused_naming_the_flag() -> None:
    from controller.main import _start_metrics
    from controller.metrics import Metrics
    from controller.proxy.config import ProxyConfig

    with pytest.raises(InvalidArgument, match="--metrics-port 99999"):   # before: OverflowError
        _start_metrics(Metrics(), 99999, "127.0.0.1")
    for listen in ("127.0.0.1:99999", "127.0.0.1:abc"):   # before: listened on 34463; "invalid literal for int()"
        with pytest.raises(InvalidArgument, match="--listen"):
            ProxyConfig(controller="127.0.0.1:50051", listen=listen)
    assert ProxyConfig(controller="127.0.0.1:50051", listen="127.0.0.1:0").port == 0


def test_the_proxy_takes_kvfleet_token_when_its_own_variable_is_unset() -> None:
    from controller.proxy.main import parse_args

    assert parse_args([], {"KVFLEET_TOKEN": "kvf_a"}).token == "kvf_a"     # before: None (0 workers known)
    assert parse_args([], {"KVFLEET_TOKEN": "kvf_a", "KVFLEET_PROXY_TOKEN": "kvf_p"}).token == "kvf_p"


def test_a_demo_of_one_block_per_worker_is_a_clear_error() -> None:
    from fleet.app.demo.workload import DemoConfig

    with pytest.raises(ValueError, match="--num-blocks"):   # before: AssertionError
        DemoConfig(num_blocks=1)


@pytest.mark.parametrize("command", ["session", "worker", "quarantine"])
def test_a_negative_watch_count_is_refused_naming_the_flag(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    parse = importlib.import_module(f"fleet.app.cli.{command}").parse
    with pytest.raises(SystemExit) as e:   # before: accepted, and the watch drew one frame and stopped
        parse(["ls", "--watch", "--count", "-1"])
    assert e.value.code == 2 and "argument --count: -1: give 0 (until Ctrl-C) or more" in capsys.readouterr().err
    assert parse(["ls", "--watch", "--count", "0"]).count == 0 and parse(["ls", "--watch", "--count", "3"]).count == 3  # control


def test_the_proxy_refuses_a_controller_address_no_client_can_reach() -> None:
    from controller.proxy.config import ProxyConfig

    for bad in ("127.0.0.1:0", ":50051"):   # before: taken; the proxy ran knowing no worker, 503 to every request
        with pytest.raises(InvalidArgument, match="--controller: the controller's address"):
            ProxyConfig(controller=bad, listen="127.0.0.1:0")
    assert ProxyConfig(controller="kvfleet-controller:50051", listen="127.0.0.1:0").controller  # control


@pytest.mark.parametrize(("flag", "value"), [("--num-cpus", "-2"), ("--sim-workers", "-1"), ("--num-cpus", "two")])
def test_up_refuses_a_negative_count_before_starting_anything(flag: str, value: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.app.cli.up import parse

    # before: --num-cpus -2 started Ray and ended in its ValueError traceback; --sim-workers -1 ran as 0
    with pytest.raises(SystemExit) as e:
        parse([flag, value])
    assert e.value.code == 2 and f"argument {flag}: " in capsys.readouterr().err
    assert (parse(["--num-cpus", "0"]).num_cpus, parse(["--sim-workers", "2"]).sim_workers) == (0, 2)  # control


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1:abc", "50051"])
def test_up_refuses_a_bad_listen_address_before_anything_starts(listen: str, tmp_path: Path) -> None:
    # before: refused by the controller's config only after the state dir and the local Ray (about 10 s) were made
    import os
    import subprocess
    import sys

    state = tmp_path / "state"
    r = subprocess.run([sys.executable, "-m", "fleet.app.cli.main", "up", "--listen", listen, "--state-dir", str(state),
                        "--num-cpus", "1"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RAY_ADDRESS": ""})
    print(r.returncode, r.stderr)
    assert r.returncode == 2 and f"argument --listen: {listen!r} must be HOST:PORT" in r.stderr
    assert not state.exists() and "Ray" not in r.stderr  # nothing was started (the state dir comes before Ray)
    from fleet.app.cli.up import parse

    assert parse(["--listen", "127.0.0.1:0"]).listen == "127.0.0.1:0"  # control: port 0 (any free) is taken


def test_a_demo_with_a_bad_ray_address_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.app.cli.demo import main

    assert main(["--ray-address", "nonsense", "--quiet"]) == 2   # before: a traceback and exit 1
    err = capsys.readouterr().err
    assert "kvfleet demo: error: --ray-address" in err and "Traceback" not in err, err


def test_up_reads_the_gc_variables_its_help_names(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.app.cli.up import parse

    monkeypatch.setenv("KVFLEET_GC_INTERVAL", "7")
    monkeypatch.setenv("KVFLEET_VERDICT_TTL", "9000")
    a = parse([])
    assert (float(a.gc_interval), float(a.verdict_ttl)) == (7.0, 9000.0)   # before: 300 and the default, unread
    monkeypatch.setenv("KVFLEET_GC_INTERVAL", "abc")
    with pytest.raises(SystemExit) as e:
        parse([])
    assert e.value.code == 2 and "--gc-interval" in capsys.readouterr().err


def test_an_empty_mint_name_and_a_bad_salt_secret_are_one_line_naming_them(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from controller.main import main

    tokens = str(tmp_path / "tokens.json")
    assert main(["--mint-token", "", "--tokens-file", tokens], {}) == 2      # before: started a server
    assert "--mint-token needs a tenant name" in capsys.readouterr().err
    assert main(["--listen", "127.0.0.1:0", "--store", f"sqlite:///{tmp_path}/k.db"],
                {"KVFLEET_SALT_SECRET": "zz"}) == 2                            # before: fromhex()'s words alone
    assert "KVFLEET_SALT_SECRET must be hex digits" in capsys.readouterr().err


def test_sim_vllm_names_a_host_it_cannot_resolve(capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.app.testkit.sim_vllm.main import _parse

    with pytest.raises(SystemExit) as e:   # before: "choose another --kv-events-port"
        _parse(["--host", "999.1.1.1"])
    assert e.value.code == 2 and "--host '999.1.1.1'" in capsys.readouterr().err


def test_the_proxy_takes_the_refresh_its_docs_name() -> None:
    from controller.proxy.main import config_from, parse_args

    assert config_from(parse_args(["--refresh", "2.5"], {})).refresh_s == 2.5   # before: unrecognized arguments
    assert config_from(parse_args([], {"KVFLEET_PROXY_REFRESH": "3"})).refresh_s == 3.0
