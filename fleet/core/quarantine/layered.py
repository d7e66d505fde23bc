"""The layered detector: fast rules (layer 1), the learned n-gram classifier (layer 2) and the fine-tuned
encoder (layer 3), per-tenant config.

    rules   (rules.py, detector.py)  score >= rule_threshold  -> QUARANTINED, reasons = rule categories
    learned (learned.py)             P(injection) >= learned_threshold -> QUARANTINED, reason "learned:0.913"
    encoder (encoder.py)             any member's P(injection) >= its threshold -> QUARANTINED,
                                     reason "encoder:<member>:0.874" per member (ENCODER_MODELS: two runs)
                                     both read `unquoted_view`: quotations inside texts about attacks are blanked
    encoder_gate (optional)          the encoder runs only when the learned score >= encoder_gate; below it the
                                     encoder is not run and cannot quarantine (reason "encoder-gated:learned<0.5000")
    encoder_max_fragmentation (opt.) an encoder window counts only if at most this share of its tokens are word
                                     pieces; none passing: the encoder reads nothing ("encoder-gated:fragmentation>0.20")

Policy: a tool result is quarantined when *any* enabled layer says so; every verdict lists the rule
categories that fired and the score of every model layer that ran. The model layers run on every
input (not only on what the rules let through) so that their scores are always in the verdict.

    cfg = DetectorConfig(learned_threshold=0.8)          # one per tenant
    det = make_detector(cfg); det.inspect(data).reasons   # ['instruction_override', 'learned:0.991']
    det.config_id                                          # stable id: config + model digest
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import numpy as np

from fleet.core.quarantine import text as T
from fleet.core.quarantine.detector import PromptInjectionDetector, Verdict, blank_quotations
from fleet.core.quarantine.detector_config import DetectorConfig
from fleet.core.quarantine.encoder import (
    EncoderModel,
    load_encoder,
)
from fleet.core.quarantine.learned import LearnedModel, load_model


class LayeredDetector:
    """Rules, learned, encoder; quarantines when any enabled layer does. Stateless, thread-safe."""

    def __init__(
        self, cfg: DetectorConfig, model: LearnedModel | None = None, encoders: tuple[EncoderModel, ...] = ()
    ) -> None:
        """Args:
        cfg: the configuration.
        model: the learned model (defaults to the shipped `cfg.model`); tests and training pass their own.
        encoders: the encoder layer's members (default: the shipped `cfg.encoder_models`).

        Raises:
            encoder.EncoderUnavailable: "encoder" is enabled and its packages or base weights are missing.
        """
        self.cfg = cfg
        cats = frozenset(cfg.rule_categories) if cfg.rule_categories is not None else None
        self.rules = (
            PromptInjectionDetector(cfg.rule_threshold, categories=cats) if "rules" in cfg.layers else None
        )
        self.model = (model or load_model(cfg.model)) if "learned" in cfg.layers else None
        self.learned_threshold = (
            cfg.learned_threshold
            if cfg.learned_threshold is not None
            else (self.model.threshold if self.model is not None else 1.0)
        )
        on = "encoder" in cfg.layers
        self.encoders = (encoders or tuple(load_encoder(n) for n in cfg.encoder_models)) if on else ()
        assert len(self.encoders) in (0, len(cfg.encoder_models)), "encoders: one per cfg.encoder_models member"
        self.member_names = cfg.encoder_models if self.encoders else ()
        t = cfg.encoder_threshold
        self.encoder_thresholds = (
            t if isinstance(t, tuple) else tuple(m.threshold if t is None else t for m in self.encoders)
        )
        # Past its window budget the encoder reads the windows the n-gram model scores highest.
        self._ranker = self.model or (load_model(cfg.model) if self.encoders else None)
        self.config_id = _config_id(cfg, self.learned_threshold, self.model, self.encoder_thresholds, self.encoders)

    def inspect(self, text: str | bytes | bytearray | memoryview) -> Verdict:
        """Run every enabled layer on `text`.

        Returns:
            Verdict(quarantined, reasons = rule categories (sorted) + ["learned:<p>"] and one
            "encoder:<member>:<p>" per encoder member, for the model layers that ran, or "encoder-gated:..."
            when the config's encoder_gate kept the encoder from running; score = the rules' score,
            learned_score = the learned layer's P(injection), encoder_score = the highest member's).
        """
        raw = T.decode_bytes(text)
        norm = T.normalize(raw)  # NOTE: once, for the rules and the model layers' view
        rv = self.rules.judge(raw, norm) if self.rules is not None else Verdict(False)
        reasons, hit = list(rv.reasons), rv.quarantined
        p = q = None
        view = blank_quotations(norm) if self.model is not None or self.encoders else ""
        del norm  # NOTE: the model layers read the view; a 1 MiB text's copy is freed before their peak (#28)
        if self.model is not None:
            p = round(self.model.score(view), 4)
            reasons.append(f"learned:{p:.4f}")
            hit = hit or p >= self.learned_threshold
        if self.encoders and gated_out(self.cfg, p):
            reasons.append(gate_reason(self.cfg))  # NOTE: the encoder is not run; it cannot quarantine
            return Verdict(quarantined=hit, reasons=reasons, score=rv.score, learned_score=p)
        ranker, phi = self._ranker, self.cfg.encoder_max_fragmentation
        read: dict[tuple[int, int, int], list[list[int]]] = {}  # members that window alike tokenize and rank once
        for enc, threshold, name in zip(self.encoders, self.encoder_thresholds, self.member_names, strict=True):
            assert ranker is not None
            if enc.window_key not in read:
                ws = enc.read_windows(view, rank=lambda s: float(np.max(ranker.window_logits(s))))
                # NOTE: the windows are chosen first (the learned layer's ranking, as measured), then gated
                read[enc.window_key] = ws if phi is None else [w for w in ws if enc.fragmentation(w) <= phi]
            if not read[enc.window_key]:  # every window cut into word pieces past the gate: this member reads none
                continue
            qm = round(enc.score_windows(read[enc.window_key]), 4)
            reasons.append(f"encoder:{name}:{qm:.4f}")
            hit = hit or qm >= threshold
            q = qm if q is None else max(q, qm)
        if self.encoders and q is None:  # only the fragmentation gate leaves every member without a window
            reasons.append(fragmentation_reason(self.cfg))
        return Verdict(quarantined=hit, reasons=reasons, score=rv.score, learned_score=p, encoder_score=q)


def gated_out(cfg: DetectorConfig, learned_score: float | None) -> bool:
    """Whether `cfg`'s encoder gate keeps the encoder from judging a text whose learned score is
    `learned_score` (the verdict's 4-decimal one): a gate is set and the score is below it."""
    return cfg.encoder_gate is not None and (learned_score is None or learned_score < cfg.encoder_gate)


def fragmentation_reason(cfg: DetectorConfig) -> str:
    """The reason a verdict carries when no window of the text passed the encoder's fragmentation gate."""
    assert cfg.encoder_max_fragmentation is not None
    return f"encoder-gated:fragmentation>{cfg.encoder_max_fragmentation:.2f}"


def gate_reason(cfg: DetectorConfig) -> str:
    """The reason a verdict carries when the encoder gate kept the encoder from running."""
    assert cfg.encoder_gate is not None
    return f"encoder-gated:learned<{cfg.encoder_gate:.4f}"


OPTIONAL_GATES = ("encoder_gate", "encoder_max_fragmentation")  # left out of a config's id while unset


def member_scores(v: Verdict) -> dict[str, float]:
    """{encoder member: its P(injection)} from a verdict's "encoder:<member>:<p>" reasons (empty: no encoder ran)."""
    return {m: float(p) for tag, m, p in (r.split(":") for r in v.reasons if r.count(":") == 2) if tag == "encoder"}


def make_detector(cfg: DetectorConfig | None = None) -> LayeredDetector:
    """The detector for `cfg` (default: the shipped layered policy)."""
    return LayeredDetector(cfg or DetectorConfig())


def _config_id(
    cfg: DetectorConfig,
    learned_threshold: float,
    model: LearnedModel | None,
    encoder_thresholds: tuple[float, ...],
    encoders: tuple[EncoderModel, ...],
) -> str:
    """sha256 of the config, the effective thresholds and the models' weights: equal ids, equal verdicts."""
    doc = {
        # NOTE: an ungated config keeps the id it had before the gates existed
        "cfg": {k: v for k, v in asdict(cfg).items() if k not in OPTIONAL_GATES or v is not None},
        "learned_threshold": learned_threshold,
        "model": model.digest() if model else None,
        "encoder_thresholds": list(encoder_thresholds),
        "encoders": [e.digest() for e in encoders],
    }
    return "det-" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]
