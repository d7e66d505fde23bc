"""Real benign text: files shipped inside popular wheels, and the first packages' docs and code."""

from __future__ import annotations

import hashlib
import random
import re
import zipfile
from pathlib import Path
from typing import Any

from injection_corpus.sources import (
    ATTACK_DATA_RE,
    BENIGN_WHEELS,
    CHUNK_CHARS,
    FILE_KINDS,
    MAX_CODE_CHUNKS,
    MAX_FILE_CHUNKS,
    MAX_PKG_CHUNKS,
    Example,
    split_of,
)


# ---- real benign text: files shipped inside popular wheels -------------------------------------------
def _chunks(text: str) -> list[str]:
    """`text` cut at line ends into pieces of at most ~CHUNK_CHARS (what a file-read or fetch tool returns)."""
    out, buf = [], ""
    for line in text.splitlines(keepends=True):
        if len(buf) + len(line) > CHUNK_CHARS and buf:
            out.append(buf)
            buf = ""
        buf += line[: 4 * CHUNK_CHARS]
    return [c for c in [*out, buf] if len(c.strip()) >= 200][:MAX_FILE_CHUNKS]


def package_chunks(z: zipfile.ZipFile) -> list[tuple[str, str, str]]:
    """(path, kind, text) of every text chunk of the wheel's files (README = METADATA's body)."""
    out = []
    for name in sorted(z.namelist()):
        base = name.rsplit("/", 1)[-1]
        ext = "." + base.rsplit(".", 1)[-1] if "." in base else ""
        readme = name.endswith(".dist-info/METADATA")
        if not readme and (".dist-info/" in name or ext not in FILE_KINDS or ATTACK_DATA_RE.search(base)):
            continue
        raw = z.read(name)
        if len(raw) > 2_000_000 or b"\x00" in raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        if readme:
            text = text.split("\n\n", 1)[-1]
        out += [(name, "readme" if readme else FILE_KINDS[ext], c) for c in _chunks(text)]
    return out


def load_package_files(corpus_dir: Path, rng: random.Random) -> tuple[list[Example], list[dict[str, Any]]]:
    """Benign chunks of real files, split by *package* within each group (injection-docs / general)."""
    out, provenance = [], []
    for group, fnames in BENIGN_WHEELS.items():
        splits = split_of(list(fnames), rng)
        for fname in fnames:
            path = corpus_dir / fname
            z = zipfile.ZipFile(path)
            pkg, version = fname.split("-")[0], fname.split("-")[1]
            chunks = package_chunks(z)
            picked = sorted(rng.sample(range(len(chunks)), min(MAX_PKG_CHUNKS, len(chunks))))
            out += [
                Example(chunks[i][2], 0, "pypi-files", f"{pkg}=={version}:{chunks[i][0]}", splits[fname], f"{group}/{chunks[i][1]}")
                for i in picked
            ]
            provenance.append({
                "package": pkg, "version": version, "licence": _licence(z), "wheel": fname, "group": group,
                "split": splits[fname], "num_chunks": len(picked),
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            })
    return out, provenance


def _licence(z: zipfile.ZipFile) -> str:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode(errors="replace")
    for pat in (r"^License-Expression: *(.+)$", r"^Classifier: License :: .*:: (.+)$", r"^License: *(.+)$"):
        if m := re.search(pat, meta, re.M):
            return m.group(1).strip()[:60]
    return "unknown"


# ---- package docs -------------------------------------------------------------------------------------
def load_docs(wheels: dict[str, zipfile.ZipFile], rng: random.Random) -> list[Example]:
    chunks: list[tuple[str, str]] = []
    for pkg, z in sorted(wheels.items()):
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        body = z.read(meta).decode().split("\n\n", 1)[1]
        buf = ""
        for para in re.split(r"\n\s*\n", body):
            buf = f"{buf}\n\n{para}".strip()
            if len(buf) >= 300:
                chunks.append((pkg, buf[:1500]))
                buf = ""
    splits = split_of([f"{p}:{i}" for i, (p, _) in enumerate(chunks)], rng)
    return [
        Example(t, 0, "package-docs", f"{p}:{i}", splits[f"{p}:{i}"], f"docs:{p}")
        for i, (p, t) in enumerate(chunks)
    ]


# ---- package source code -----------------------------------------------------------------------------
def load_code(wheels: dict[str, zipfile.ZipFile], rng: random.Random) -> list[Example]:
    """Benign code: the packages' own Python files, cut into chunks (split by file, at most MAX_CODE_CHUNKS).

    The files that *build* attacks (AgentDojo's attacks/ and injection_tasks.py) are left out; detector
    code that holds attack patterns stays in: an agent reading it is reading code, not an injection.
    """
    chunks: list[tuple[str, str]] = []
    for pkg, z in sorted(wheels.items()):
        for name in sorted(z.namelist()):
            if not name.endswith(".py") or "/attacks/" in name or name.endswith("injection_tasks.py"):
                continue
            buf = ""
            for line in z.read(name).decode(errors="replace").splitlines(keepends=True):
                buf += line
                if len(buf) >= 1200:
                    chunks.append((f"{pkg}:{name}", buf))
                    buf = ""
            if len(buf) >= 200:
                chunks.append((f"{pkg}:{name}", buf))
    chunks = rng.sample(chunks, min(MAX_CODE_CHUNKS, len(chunks)))
    splits = split_of([f for f, _ in chunks], rng)
    return [Example(t, 0, "package-code", f, splits[f], "code") for f, t in chunks]
