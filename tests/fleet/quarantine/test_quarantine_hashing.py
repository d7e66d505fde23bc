"""Numpy n-gram hashing (issue #28): each vectorised hash equals the per-n-gram polynomial, a learned model on
it scores windows as the reference loop does, and the multilingual benign test part is what it claims."""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

import numpy as np

from fleet.core.quarantine.detector import unquoted_view
from fleet.core.quarantine.features import FeaturizerConfig
from fleet.core.quarantine.hashing import _mix, events
from fleet.core.quarantine.learned import LearnedModel

DATA = Path(__file__).parent / "data"
MASK = (1 << 64) - 1


def _texts() -> list[str]:
    r = random.Random(0)
    alphabet = "ab cdé  中文_x1\n\t,.ÄЖ\"' ignore all previous instructions "
    return ["", "a", "ab", "Hallo Anna, die Besprechung ist verschoben.", "您好，您的订单已发货。"] + [
        "".join(r.choice(alphabet) for _ in range(r.randint(0, 3000))) for _ in range(30)
    ]


def _bucket(s: str, salt: int, buckets: int) -> int:
    h = (sum(ord(c) * pow(0x100000001B3, j, 1 << 64) for j, c in enumerate(s)) + salt) & MASK
    return int(_mix(np.array([h], dtype=np.uint64))[0]) & (buckets - 1)


def test_vectorised_hashes_equal_the_per_ngram_polynomial() -> None:
    cfg = FeaturizerConfig(num_buckets=1 << 18, hashing="poly")
    for t in _texts()[:12]:
        norm = unquoted_view(t)
        evs = events(norm, cfg)
        if not norm:
            assert evs == []
            continue
        for (pos, buckets), n in zip(evs, cfg.char_ngrams, strict=False):
            assert list(pos) == list(range(max(0, len(norm) - n + 1)))
            for p, b in list(zip(pos, buckets, strict=True))[:40]:
                assert _bucket(norm[p : p + n], n, cfg.num_buckets) == b
        words = [(m.start(), m.end()) for m in re.finditer(r"\w+", norm)]
        for (pos, buckets), n in zip(evs[len(cfg.char_ngrams) :], cfg.word_ngrams, strict=True):
            spans = [(words[i][0], words[i + n - 1][1]) for i in range(len(words) - n + 1)]
            assert list(pos) == [a for a, _ in spans]  # one event per first word, as `\w+` splits them
            for (a, e), b in list(zip(spans, buckets, strict=True))[:40]:
                assert _bucket(norm[a:e], (1 << 40) | n, cfg.num_buckets) == b


def test_learned_model_on_numpy_hashing_scores_windows_as_the_reference_loop() -> None:
    cfg = FeaturizerConfig(num_buckets=1 << 12, hashing="poly")
    m = LearnedModel(np.random.default_rng(0).normal(size=1 << 12).astype(np.float32), 0.1, cfg, 64, 0.5)
    for t in _texts():
        fast, ref = m.window_logits(t), m.window_logits_reference(t)
        assert fast.shape == ref.shape and np.allclose(fast, ref, rtol=0, atol=1e-9), t
    assert FeaturizerConfig.from_dict(cfg.to_dict()) == cfg and "hashing" not in FeaturizerConfig().to_dict()


def test_multilingual_benign_test_part_is_real_and_varied() -> None:
    raw = gzip.decompress((DATA / "benign_multilingual_test.jsonl.gz").read_bytes()).decode()
    rows = [json.loads(line) for line in raw.splitlines()]
    langs = {
        r["group"].split("/locale/")[1].split("/")[0].split("_")[0] for r in rows if "/locale/" in r["group"]
    }
    assert all(r["label"] == 0 for r in rows) and 200 <= len(rows) <= 1000
    assert {"de", "fr", "es", "it", "nl", "pt", "pl", "ru", "zh", "ja", "ko", "ar", "tr"} <= langs
    assert {"message", "json", "log", "csv", "shell", "trace", "code", "blob"} <= {r["kind"] for r in rows}
