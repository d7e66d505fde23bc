"""The layered detector: fast rules (layer 1), then the learned classifier (layer 2), per-tenant config.

    rules   (rules.py, detector.py)  score >= rule_threshold  -> QUARANTINED, reasons = rule categories
    learned (learned.py)             P(injection) >= learned_threshold -> QUARANTINED, reason "learned:0.913"
                                     read on `unquoted_view`: quotations inside texts about attacks are blanked

Policy: a tool result is quarantined when *any* enabled layer says so; every verdict lists the rule
categories that fired and, when the learned layer ran, its score. The learned layer runs on every
input (not only on what the rules let through) so that its score is always in the verdict.

    cfg = DetectorConfig(learned_threshold=0.8)          # one per tenant
    det = make_detector(cfg); det.inspect(data).reasons   # ['instruction_override', 'learned:0.991']
    det.config_id                                          # stable id: config + model digest
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from fleet.quarantine import rules as R
from fleet.quarantine.detector import THRESHOLD, PromptInjectionDetector, Verdict, unquoted_view
from fleet.quarantine.learned import MODEL_NAME, LearnedModel, load_model

LAYERS = ("rules", "learned")


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """Which layers run and where their thresholds sit (one per tenant, defaults = shipped policy).

    Attributes:
        layers: the enabled layers, a non-empty subset of ("rules", "learned").
        rule_threshold: the rules quarantine at this summed score.
        rule_categories: the rule set (None: every category in `rules.CATEGORIES`).
        learned_threshold: P(injection) at which the learned layer quarantines (None: the model's
            threshold, chosen on the validation split by `scripts/train_detector.py`).
        model: the shipped model's name under `fleet/quarantine/model/`.
    """

    layers: tuple[str, ...] = LAYERS
    rule_threshold: float = THRESHOLD
    rule_categories: tuple[str, ...] | None = None
    learned_threshold: float | None = None
    model: str = MODEL_NAME

    def __post_init__(self) -> None:
        assert self.layers and set(self.layers) <= set(LAYERS), (
            f"layers must be a non-empty subset of {LAYERS}"
        )
        assert self.rule_threshold > 0, "rule_threshold must be > 0"
        assert self.learned_threshold is None or 0.0 <= self.learned_threshold <= 1.0, (
            "learned_threshold in [0, 1]"
        )
        unknown = set(self.rule_categories or ()) - R.CATEGORIES
        assert not unknown, f"unknown rule categories {sorted(unknown)}; known: {sorted(R.CATEGORIES)}"


class LayeredDetector:
    """Rules then learned; quarantines when any enabled layer does. Stateless, thread-safe."""

    def __init__(self, cfg: DetectorConfig, model: LearnedModel | None = None) -> None:
        """Args:
        cfg: the configuration.
        model: the learned model (defaults to the shipped `cfg.model`); tests and training pass their own.
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
        self.config_id = _config_id(cfg, self.learned_threshold, self.model)

    def inspect(self, text: str | bytes | bytearray | memoryview) -> Verdict:
        """Run every enabled layer on `text`.

        Returns:
            Verdict(quarantined, reasons = rule categories (sorted) + ["learned:<p>"] when the learned
            layer ran, score = the rules' score, learned_score = the learned P(injection)).
        """
        rv = self.rules.inspect(text) if self.rules is not None else Verdict(False)
        reasons, hit = list(rv.reasons), rv.quarantined
        p = None
        if self.model is not None:
            p = round(self.model.score(unquoted_view(text)), 4)
            reasons.append(f"learned:{p:.4f}")
            hit = hit or p >= self.learned_threshold
        return Verdict(quarantined=hit, reasons=reasons, score=rv.score, learned_score=p)


def make_detector(cfg: DetectorConfig | None = None) -> LayeredDetector:
    """The detector for `cfg` (default: the shipped layered policy)."""
    return LayeredDetector(cfg or DetectorConfig())


def _config_id(cfg: DetectorConfig, learned_threshold: float, model: LearnedModel | None) -> str:
    """sha256 of the config, the effective threshold and the model's weights: equal ids, equal verdicts."""
    doc = {
        "cfg": asdict(cfg),
        "learned_threshold": learned_threshold,
        "model": model.digest() if model else None,
    }
    return "det-" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]
