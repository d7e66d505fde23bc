"""`kvfleet proxy` flags and environment: read once at the edge; bad values exit 2 with a clear message."""

from __future__ import annotations

import pytest

from controller.proxy.main import config_from, main, parse_args


def test_flags_and_env() -> None:
    env = {"KVFLEET_CONTROLLER": "ctl:50051", "KVFLEET_PROXY_TOKEN": "kvf_x"}
    cfg = config_from(parse_args(["--listen", "0.0.0.0:9000", "--no-token-passthrough"], env))
    assert (cfg.controller, cfg.listen, cfg.token, cfg.token_passthrough) == ("ctl:50051", "0.0.0.0:9000", "kvf_x",
                                                                               False)
    cfg = config_from(parse_args(["--controller", "c:1", "--tokenizer", "hf:/models/tok"], env))
    assert (cfg.controller, cfg.token_passthrough, cfg.tokenizer) == ("c:1", True, "hf:/models/tok")
    assert cfg.tool_media == "pass" and config_from(parse_args([], {**env, "KVFLEET_TOOL_MEDIA": "refuse"})).tool_media \
        == "refuse"


@pytest.mark.parametrize("argv, message", [
    (["--listen", "nowhere"], "must be HOST:PORT"),
    (["--tokenizer", "gpt2"], "use hf:PATH"),
    (["--first-byte-timeout", "0"], "must be positive"),
    ([], "--tool-media 'strip': expected pass, withhold or refuse"),  # from KVFLEET_TOOL_MEDIA
])
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv, env={"KVFLEET_TOOL_MEDIA": "strip"} if not argv else {}) == 2
    err = capsys.readouterr().err
    print(err.strip())
    assert message in err
