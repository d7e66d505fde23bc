"""Held-out evaluation of a detector: the shipped test split, the benign tool-output sets, the repo corpus.

Used by `bench/detector_eval.py`, which computes the held-out table and writes it into the docs (the test
suite pins the shipped models' digests and a handful of verdicts instead of recomputing the table). Not part
of the runtime package: import it with the repository root on sys.path, as `bench.detector_heldout`.
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleet.core.quarantine.detector import Verdict

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"  # injection_corpus: the generated benign set

TOOL_OUTPUT_SEED, TOOL_OUTPUT_N = 0, 440  # the reported FPR set (training tuned on seed 1)
HELDOUT_FILE = "heldout_test.jsonl.gz"  # written by scripts/train_detector.py next to the tests
REAL_BENIGN_SOURCE = "pypi-files"  # test-split rows that are chunks of real files from PyPI wheels


@dataclass(frozen=True, slots=True)
class Scores:
    """Confusion counts and the derived rates of one detector on one labelled set."""

    tp: int
    fp: int
    fn: int
    tn: int

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 0.0

    @property
    def fpr(self) -> float:
        return self.fp / (self.fp + self.tn) if self.fp + self.tn else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "precision": round(self.precision, 4),
            "recall": round(self.recall, 4),
            "fpr": round(self.fpr, 4),
        }


def load_heldout(path: Path) -> list[dict[str, Any]]:
    """The test split written by `scripts/train_detector.py`: rows of text, label, source, group, kind.

    A `.gz` path is read as gzip. Rows of source REAL_BENIGN_SOURCE are the real benign tool-output set:
    their group is "<package>==<version>:<path in the wheel>".
    """
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def score(verdicts: list[Verdict], labels: list[int]) -> Scores:
    hits = [v.quarantined for v in verdicts]
    tp = sum(h and y == 1 for h, y in zip(hits, labels, strict=True))
    fp = sum(h and y == 0 for h, y in zip(hits, labels, strict=True))
    pos = sum(1 for y in labels if y == 1)
    return Scores(tp, fp, pos - tp, len(labels) - pos - fp)


def tool_outputs() -> list[tuple[str, str]]:
    """The generated benign tool-output set the docs report (scripts/injection_corpus/tool_outputs.py, seed 0)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    from injection_corpus.tool_outputs import benign_tool_outputs  # noqa: PLC0415

    return benign_tool_outputs(TOOL_OUTPUT_N, seed=TOOL_OUTPUT_SEED)
