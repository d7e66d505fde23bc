"""`kvfleet controller --mint-token` with a tokens file it cannot read: the error names the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.main import main as controller_main


@pytest.mark.parametrize("text", ["{bad", '{"tokens": 5}', "[]", '{"tokens": [{"tenant": "a"}]}'])
def test_a_malformed_tokens_file_is_named_and_left_as_it_was(tmp_path: Path, text: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # before: "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)" naming no file, an
    # AttributeError traceback for {"tokens": 5}, and a token appended to a file the controller cannot read
    f = tmp_path / "tokens.json"
    f.write_text(text)
    assert controller_main(["--mint-token", "acme", "--tokens-file", str(f)], env={}) == 2
    err = capsys.readouterr().err
    assert f"kvfleet controller: error: tokens file {f} is malformed" in err
    assert f.read_text() == text
    # Control: an empty file is a new one.
    f.write_text("")
    assert controller_main(["--mint-token", "acme", "--tokens-file", str(f)], env={}) == 0
    assert capsys.readouterr().out.startswith("kvf_")
