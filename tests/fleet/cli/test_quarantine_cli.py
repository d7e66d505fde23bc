"""`kvfleet quarantine`'s options: each one listed does something for its subcommand."""

from __future__ import annotations

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
