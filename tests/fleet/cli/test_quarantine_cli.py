"""`kvfleet quarantine`'s options: each one listed does something for its subcommand."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.app.cli import quarantine as cli_quarantine

REF = "ab" * 32


@pytest.mark.parametrize("extra", [["--json"], ["--watch"], ["--interval", "2"], ["--count", "3"]])
def test_set_takes_no_listing_options(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # before: `set` listed and took them, and did nothing with them (--json printed plain text; found by review)
    with pytest.raises(SystemExit) as e:
        cli_quarantine.parse(["set", REF, "CLEAN", *extra])
    assert e.value.code == 2 and f"unrecognized arguments: {extra[0]}" in capsys.readouterr().err
    # Control: `ls` takes each of them, and `set` still takes where and as whom.
    assert cli_quarantine.parse(["ls", *extra])
    a = cli_quarantine.parse(["set", REF, "CLEAN", "--reason", "r", "--controller", "h:1", "--token", "t", "--tls"])
    assert (a.controller, a.token, a.tls, a.reason) == ("h:1", "t", True, ["r"])


def test_set_help_lists_only_what_applies(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_quarantine.parse(["set", "--help"])
    out = capsys.readouterr().out
    assert "--controller" in out and "--reason" in out
    assert not [o for o in ("--json", "--watch", "--interval", "--count") if o in out]


def test_a_client_certificate_alone_is_used(tmp_path: Path) -> None:
    # before: TLS was passed only with --tls or --tls-ca: --tls-cert/--tls-key alone went out in plaintext
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nMA==\n-----END PRIVATE KEY-----\n")
    args = cli_quarantine.parse(["ls", "--controller", "127.0.0.1:1", "--tls-cert", str(cert), "--tls-key", str(key)])
    with cli_quarantine._client(args) as c:
        assert c._creds is not None  # TLS credentials carrying the client certificate
    with cli_quarantine._client(cli_quarantine.parse(["ls", "--controller", "127.0.0.1:1"])) as c:
        assert c._creds is None  # control: no TLS flag, plaintext
