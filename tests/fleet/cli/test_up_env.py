"""`kvfleet up` reads the environment variables of the flags it shares with `kvfleet controller` (docs/deploy.md,
section 10), the command line winning, as the controller does."""

from __future__ import annotations

import pytest

from controller.edge import edge_config_from
from fleet.app.cli.up import parse as up_parse

ENV = {"KVFLEET_UPLOAD_MIN_RATE": "1234", "KVFLEET_MAX_ROUTE_TOKENS": "4096", "KVFLEET_GRPC_KEEPALIVE": "7.5",
       "KVFLEET_NODE_KV_BYTES": "8192", "KVFLEET_NODE_MAX_SESSIONS": "9"}


def test_up_reads_the_edge_and_node_variables_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    args = up_parse([])
    edge = edge_config_from(args)
    assert (edge["uploads"].min_rate, edge["max_route_tokens"], edge["grpc_limits"].keepalive_s) == (1234, 4096, 7.5)
    assert (args.node_kv_bytes, args.node_max_sessions) == (8192, 9)
    given = up_parse(["--upload-min-rate", "99", "--node-kv-bytes", "100"])
    assert edge_config_from(given)["uploads"].min_rate == 99 and given.node_kv_bytes == 100


def test_a_bad_variable_is_a_usage_error_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVFLEET_NODE_KV_BYTES", "2GiB")
    with pytest.raises(SystemExit) as exit_:
        up_parse([])
    assert exit_.value.code == 2 and "KVFLEET_NODE_KV_BYTES" in capsys.readouterr().err
