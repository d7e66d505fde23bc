"""A model soup of encoder runs (round eight of issue #15): the mean of several runs' weights, one model.

    python scripts/soup_encoder.py --corpus-dir CORPUS --out FOLDER RUN RUN [RUN ...]

Each RUN is a folder `scripts/train_encoder.py --out` wrote (adapter, head, encoder.json with its validation
figures). All must share the base weights, the window and the LoRA settings. The soup of k runs is the
uniform mean of their full weights: each LoRA delta (B A alpha / r) is averaged exactly by stacking the k
adapters into one of rank k r (A stacked, B stacked and divided by k, alpha k times as large, so alpha / r is
unchanged), and the heads are averaged. peft merges the adapter into the base at load, so a soup costs the
same CPU per KiB as one run.

The soup is greedy (Wortsman et al., "Model soups", ICML 2022): the runs are taken in the order of their own
layered validation recall, best first; the next run joins if the soup's layered validation recall, at the
threshold the training script's rule picks under the same bounds, does not fall. `--uniform` also scores the
mean of all the runs (reported, not chosen). The test split is not read here. The chosen soup is written to
`--out` with its threshold and validation figures; a soup of one run is that run, copied.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import train_detector as TD  # noqa: E402
from train_encoder import ValidationSet, publish, score_on_validation  # noqa: E402


def run_doc(run: Path) -> dict[str, Any]:
    return json.loads((run / "encoder.json").read_text())


def make_soup(runs: list[Path], folder: Path) -> None:
    """Write the uniform soup of `runs` to `folder` (adapter, head, encoder.json without a threshold yet)."""
    import torch
    from safetensors.torch import load_file, save_file

    docs = [run_doc(r) for r in runs]
    for d in docs[1:]:
        for key in ("base", "window"):
            if d[key] != docs[0][key]:
                raise SystemExit(f"the runs differ in {key}: {d[key]} vs {docs[0][key]}")
        if d["training"]["lora"] != docs[0]["training"]["lora"]:
            raise SystemExit("the runs differ in their LoRA settings")
    k = len(runs)
    tensors = [load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in runs]
    if any(t.keys() != tensors[0].keys() for t in tensors):
        raise SystemExit("the runs' adapters adapt different modules")
    soup: dict[str, Any] = {}
    for name in tensors[0]:
        parts = [t[name].float() for t in tensors]
        if ".lora_A." in name:
            soup[name] = torch.cat(parts, dim=0)  # (k r, in)
        elif ".lora_B." in name:
            soup[name] = torch.cat(parts, dim=1) / k  # (out, k r)
        else:
            raise SystemExit(f"unexpected adapter tensor {name}")
    (folder / "adapter").mkdir(parents=True)
    save_file({n: v.to(torch.float16).contiguous() for n, v in soup.items()},
              str(folder / "adapter" / "adapter_model.safetensors"))
    cfg = json.loads((runs[0] / "adapter" / "adapter_config.json").read_text())
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("use_rslora"):
        raise SystemExit("rank or alpha patterns and rsLoRA are not supported")
    cfg["r"], cfg["lora_alpha"] = cfg["r"] * k, cfg["lora_alpha"] * k
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    heads = [load_file(str(r / "head.safetensors")) for r in runs]
    save_file({n: (sum(h[n].float() for h in heads) / k).to(torch.float16).contiguous() for n in heads[0]},
              str(folder / "head.safetensors"))
    doc = {"base": docs[0]["base"], "window": docs[0]["window"], "threshold": 1.0,
           "training": {"soup": {"kind": "uniform mean of the runs' weights", "runs": [d["training"] for d in docs]}}}
    (folder / "encoder.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", type=Path, required=True, help="folder holding the wheels train_detector.py lists")
    ap.add_argument("--out", type=Path, required=True, help="where to write the chosen soup")
    ap.add_argument("--uniform", action="store_true", help="also score the mean of all the runs (reported only)")
    ap.add_argument("runs", type=Path, nargs="+")
    a = ap.parse_args()
    data, _, _ = TD.build_data(a.corpus_dir)
    vset = ValidationSet.build([e for e in data if e.split == "val"])
    work = Path(tempfile.mkdtemp(prefix="encoder-soup-"))
    runs = sorted(a.runs, key=lambda r: -run_doc(r)["validation"]["layered"]["recall"])
    for r in runs:
        print(f"run {r}: validation {run_doc(r)['validation']['layered']}", flush=True)

    def score(members: list[Path]) -> dict[str, Any]:
        folder = work / f"soup-{len(list(work.iterdir()))}"
        make_soup(members, folder)
        return {"folder": folder, "members": [str(m) for m in members]} | score_on_validation(folder, vset)

    soup, best = [runs[0]], score([runs[0]])
    print(f"soup of 1: validation {best['layered']}", flush=True)
    trail = [{"members": best["members"], "recall": best["layered"].get("recall"), "joined": True}]
    for r in runs[1:]:
        cand = score([*soup, r])
        joins = cand["layered"].get("recall", -1.0) >= best["layered"].get("recall", -1.0)
        print(f"soup + {r}: threshold {cand['threshold']:.4f}, validation {cand['layered']}; "
              f"{'joins' if joins else 'left out'}", flush=True)
        trail.append({"members": cand["members"], "recall": cand["layered"].get("recall"), "joined": joins})
        if joins:
            soup, best = [*soup, r], cand
    doc = run_doc(best["folder"])
    doc["threshold"] = best["threshold"]
    doc["validation"] = vset.doc(best) | {"greedy": trail}
    if a.uniform and len(runs) > 2:
        uni = score(runs)
        print(f"uniform soup of all {len(runs)}: threshold {uni['threshold']:.4f}, validation {uni['layered']}")
        doc["validation"]["uniform_all"] = {"threshold": uni["threshold"], "layered": uni["layered"]}
    publish(best["folder"], doc, a.out)
    shutil.rmtree(work)
    print(f"chose the soup of {[str(s) for s in soup]}: threshold {best['threshold']:.4f}; wrote {a.out}")


if __name__ == "__main__":
    main()
