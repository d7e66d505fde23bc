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
    assert cli_quarantine.parse(["ls", "--watch", *extra])  # --count counts --watch's refreshes (ls_modes.py)
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


@pytest.mark.parametrize("width", [80, 40, 30])
def test_ls_at_a_narrow_terminal_cuts_no_cell(width: int) -> None:
    # before: at 80 columns "acme-res…", "placehol…", "injecti…"; at 40 the counts too, "1…" (found by review)
    import io
    from types import SimpleNamespace as NS

    from rich.console import Console

    r = NS(tenant="acme-research", ref=REF, action="placeholder", source="detector",
           reasons=("injection:ignore-previous", "exfil-url"), num_seen=123456, first_seen=0.0, last_seen=1000.0)
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=True, color_system=None).print(
        cli_quarantine.render([r], now=100000.0, width=width))
    text = out.getvalue()
    print(text)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "123456" in text and "99000s ago" in text  # numbers never wrap
    unfolded = _unfolded(text)
    assert [w for w in ("acme-research", "placeholder", "injection:ignore-previous,exfil-url")
            if not any(w in u for u in unfolded)] == []
    assert text.count("…") == 1  # the ref's, shortened on purpose (--json has it whole)


def _unfolded(text: str) -> list[str]:
    """Each column's lines joined, white space dropped (a table of one row), or the whole text so (records): a
    folded cell is whole again."""
    rows = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│")]
    if not rows:
        return ["".join(text.split())]
    return ["".join("".join(r[i].split()) for r in rows) for i in range(len(rows[0]))]
