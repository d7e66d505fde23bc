"""A SQLite store whose file cannot be written, or is not a database, is refused at open with an error that names
the file and the fix, and the file is left as it was.

NOTE: before, `open_store` raised the raw sqlite3 error of its first write ("unable to open database file",
"file is not a database"), and `kvfleet controller` on a read-only volume died with a traceback. The review saw it
on a read-only bind mount of a directory holding a store; here the -wal file beside the database cannot be made (a
directory holds its name), which fails SQLite's first write the same way, and needs no mount.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleet.cas import open_store
from fleet.core.errors import InvalidArgument, Unavailable


def _store_with_a_blob(path: Path) -> str:
    with open_store(f"sqlite:///{path}") as store:
        return store.put(b"kept", "acme")


def test_a_database_that_cannot_be_written_is_unavailable_naming_its_directory(tmp_path: Path) -> None:
    db = tmp_path / "kvfleet.db"
    ref = _store_with_a_blob(db)
    before = db.read_bytes()
    (tmp_path / "kvfleet.db-wal").mkdir()  # SQLite cannot make its WAL file: as on a read-only volume
    with pytest.raises(Unavailable) as ei:
        open_store(f"sqlite:///{db}")
    msg = str(ei.value)
    assert str(db) in msg and f"{tmp_path} must be a writable directory" in msg, msg
    assert db.read_bytes() == before
    (tmp_path / "kvfleet.db-wal").rmdir()
    with open_store(f"sqlite:///{db}") as store:  # nothing was lost
        assert store.get(ref, "acme") == b"kept"


def test_a_file_that_is_not_a_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_bytes(b"not a database, " * 64)
    with pytest.raises(InvalidArgument) as ei:
        open_store(f"sqlite:///{f}")
    assert str(f) in str(ei.value) and "file is not a database" in str(ei.value)
    assert f.read_bytes() == b"not a database, " * 64


def test_a_directory_that_cannot_be_made_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"")
    with pytest.raises(Unavailable, match="its directory cannot be made"):
        open_store(f"sqlite:///{tmp_path / 'plain' / 'kvfleet.db'}")


def test_the_controller_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    db = tmp_path / "kvfleet.db"
    _store_with_a_blob(db)
    (tmp_path / "kvfleet.db-wal").mkdir()
    out = subprocess.run([sys.executable, "-m", "controller.main", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                          "--store", f"sqlite:///{db}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert f"kvfleet controller: error: sqlite database {db} cannot be written" in out.stderr
