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


def _mint_many(path: str, n: int) -> list[str]:
    from controller.auth import mint_token

    return [mint_token(path, "acme", "tenant") for _ in range(n)]


def test_mints_at_once_keep_every_token_and_a_loadable_file(tmp_path: Path) -> None:
    """NOTE: each mint read the file, appended and wrote back one shared `<file>.tmp`: of 40 mints in 8
    processes, some raised, printed tokens went missing from the file, and once it no longer loaded."""
    import concurrent.futures
    import multiprocessing

    from controller.auth import TokenBook

    f = tmp_path / "tokens.json"
    with concurrent.futures.ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as pool:
        tokens = [t for ts in pool.map(_mint_many, [str(f)] * 8, [5] * 8) for t in ts]
    book = TokenBook(f)
    assert len(tokens) == 40 and all(book.lookup(t) is not None for t in tokens)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.json", "tokens.json.lock"]  # no temporary left
