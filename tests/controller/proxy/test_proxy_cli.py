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
    assert cfg.tokenize_cache_bytes == 64 << 20
    assert config_from(parse_args(["--tokenize-cache-mib", "0"], env)).tokenize_cache_bytes == 0
    assert config_from(parse_args([], {"KVFLEET_PROXY_TOKENIZE_CACHE_MIB": "8"})).tokenize_cache_bytes == 8 << 20


def test_first_byte_timeout_default_env_and_flag() -> None:
    # the default is measured (docs/proxy.md, "Failover"): a probe 0.25 s after a silent send finds a sleeper
    assert config_from(parse_args([], {})).first_byte_timeout_s == 0.25
    env = {"KVFLEET_PROXY_FIRST_BYTE_TIMEOUT": "1.5"}
    assert config_from(parse_args([], env)).first_byte_timeout_s == 1.5
    assert config_from(parse_args(["--first-byte-timeout", "0.1"], env)).first_byte_timeout_s == 0.1  # flags win
    # the floor of the adaptive first wait (docs/proxy.md): 0.05 s unless set
    assert config_from(parse_args([], {})).first_byte_min_s == 0.05
    assert config_from(parse_args([], {"KVFLEET_PROXY_FIRST_BYTE_MIN": "0.25"})).first_byte_min_s == 0.25
    assert config_from(parse_args(["--first-byte-min", "0.1"], {})).first_byte_min_s == 0.1


def test_a_bad_first_byte_timeout_env_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([], env={"KVFLEET_PROXY_FIRST_BYTE_TIMEOUT": "soon"})
    err = capsys.readouterr().err
    print(err.strip())
    assert e.value.code == 2 and "--first-byte-timeout: invalid float value: 'soon'" in err


@pytest.mark.parametrize("argv, message", [
    (["--listen", "nowhere"], "must be HOST:PORT"),
    (["--tokenizer", "gpt2"], "use hf:PATH"),
    (["--first-byte-timeout", "0"], "must be positive"),
    (["--first-byte-min", "-1"], "must be positive"),
    (["--tokenize-cache-mib", "-1"], "the tokenize cache's bounds >= 0"),
    ([], "--tool-media 'strip': expected pass, withhold or refuse"),  # from KVFLEET_TOOL_MEDIA
])
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv, env={"KVFLEET_TOOL_MEDIA": "strip"} if not argv else {}) == 2
    err = capsys.readouterr().err
    print(err.strip())
    assert message in err
