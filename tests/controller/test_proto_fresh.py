"""The committed stubs in fleet/api are exactly what scripts/gen_proto.py makes from proto/ now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    gen = _gen_module()
    gen.generate(tmp_path / "api")
    fresh, committed = _tree(tmp_path / "api"), _tree(ROOT / "fleet" / "api")
    assert len(fresh) >= 3 * len(gen.proto_files()) + 3  # pb2, pyi, pb2_grpc per proto + 3 __init__
    stale = sorted(k for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k))
    assert not stale, f"stale generated stubs {stale}: run `python scripts/gen_proto.py` and commit fleet/api"


def test_freshness_check_detects_an_edit(tmp_path: Path) -> None:
    # control: the comparison above is not vacuous; a one-byte change in a proto changes the output
    gen = _gen_module()
    gen.generate(tmp_path / "a")
    proto = tmp_path / "p" / "kvfleet" / "v1"
    proto.mkdir(parents=True)
    for f in gen.proto_files():
        (proto / f.name).write_text(f.read_text().replace("uint32 chunk_size = 2;", "uint64 chunk_size = 2;"))
    gen.PROTO_ROOT = tmp_path / "p"
    gen.generate(tmp_path / "b")
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    changed = sorted(k for k in a if a[k] != b.get(k))
    print("files changed by a one-field edit:", changed)
    assert "kvfleet/v1/blobs_pb2.py" in changed
