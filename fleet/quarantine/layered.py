"""The layered detector: fast rules (layer 1), the learned n-gram classifier (layer 2) and the fine-tuned
encoder (layer 3), per-tenant config.

    rules   (rules.py, detector.py)  score >= rule_threshold  -> QUARANTINED, reasons = rule categories
    learned (learned.py)             P(injection) >= learned_threshold -> QUARANTINED, reason "learned:0.913"
    encoder (encoder.py)             P(injection) >= encoder_threshold -> QUARANTINED, reason "encoder:0.874"
                                     both read `unquoted_view`: quotations inside texts about attacks are blanked

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
import math
from dataclasses import asdict, dataclass

import numpy as np

from fleet.quarantine import rules as R
from fleet.quarantine.detector import THRESHOLD, PromptInjectionDetector, Verdict, unquoted_view
from fleet.quarantine.encoder import ENCODER_NAME, INSTALL_HINT, EncoderModel, load_encoder, missing_modules
from fleet.quarantine.learned import MODEL_NAME, LearnedModel, load_model

LAYERS = ("rules", "learned", "encoder")
DEFAULT_LAYERS = ("rules", "learned", "encoder")


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """Which layers run and where their thresholds sit (one per tenant, defaults = shipped policy).

    Attributes:
        layers: the enabled layers, a non-empty subset of LAYERS (default: all three; "encoder" needs
            `pip install 'kvfleet[encoder]'`, and `encoder.EncoderUnavailable` says so when it is missing).
        rule_threshold: the rules quarantine at this summed score.
        rule_categories: the rule set (None: every category in `rules.CATEGORIES`).
        learned_threshold: P(injection) at which the learned layer quarantines (None: the model's
            threshold, chosen on the validation split by `scripts/train_detector.py`).
        model: the shipped model's name under `fleet/quarantine/model/`.
        encoder_threshold: P(injection) at which the encoder layer quarantines (None: the threshold
            `scripts/train_encoder.py` chose on the validation split).
        encoder_model: the shipped encoder adapter's folder under `fleet/quarantine/model/`.
    """

    layers: tuple[str, ...] = DEFAULT_LAYERS
    rule_threshold: float = THRESHOLD
    rule_categories: tuple[str, ...] | None = None
    learned_threshold: float | None = None
    model: str = MODEL_NAME
    encoder_threshold: float | None = None
    encoder_model: str = ENCODER_NAME

    def __post_init__(self) -> None:
        assert self.layers and set(self.layers) <= set(LAYERS), (
            f"layers must be a non-empty subset of {LAYERS}"
        )
        assert self.rule_threshold > 0, "rule_threshold must be > 0"
        assert self.learned_threshold is None or 0.0 <= self.learned_threshold <= 1.0, (
            "learned_threshold in [0, 1]"
        )
        assert self.encoder_threshold is None or 0.0 <= self.encoder_threshold <= 1.0, (
            "encoder_threshold in [0, 1]"
        )
        unknown = set(self.rule_categories or ()) - R.CATEGORIES
        assert not unknown, f"unknown rule categories {sorted(unknown)}; known: {sorted(R.CATEGORIES)}"


class LayeredDetector:
    """Rules, learned, encoder; quarantines when any enabled layer does. Stateless, thread-safe."""

    def __init__(
        self, cfg: DetectorConfig, model: LearnedModel | None = None, encoder: EncoderModel | None = None
    ) -> None:
        """Args:
        cfg: the configuration.
        model: the learned model (defaults to the shipped `cfg.model`); tests and training pass their own.
        encoder: the encoder (defaults to the shipped `cfg.encoder_model`).

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
        self.encoder = (encoder or load_encoder(cfg.encoder_model)) if "encoder" in cfg.layers else None
        self.encoder_threshold = (
            cfg.encoder_threshold
            if cfg.encoder_threshold is not None
            else (self.encoder.threshold if self.encoder is not None else 1.0)
        )
        # Past its window budget the encoder reads the windows the n-gram model scores highest.
        self._ranker = self.model or (load_model(cfg.model) if self.encoder is not None else None)
        self.config_id = _config_id(cfg, self.learned_threshold, self.model, self.encoder_threshold, self.encoder)

    def inspect(self, text: str | bytes | bytearray | memoryview) -> Verdict:
        """Run every enabled layer on `text`.

        Returns:
            Verdict(quarantined, reasons = rule categories (sorted) + ["learned:<p>"] and ["encoder:<p>"]
            for the model layers that ran, score = the rules' score, learned_score / encoder_score = those
            layers' P(injection)).
        """
        rv = self.rules.inspect(text) if self.rules is not None else Verdict(False)
        reasons, hit = list(rv.reasons), rv.quarantined
        p = q = None
        view = unquoted_view(text) if self.model is not None or self.encoder is not None else ""
        if self.model is not None:
            p = round(self.model.score(view), 4)
            reasons.append(f"learned:{p:.4f}")
            hit = hit or p >= self.learned_threshold
        if self.encoder is not None:
            ranker = self._ranker
            assert ranker is not None
            q = round(self.encoder.score(view, rank=lambda s: float(np.max(ranker.window_logits(s)))), 4)
            reasons.append(f"encoder:{q:.4f}")
            hit = hit or q >= self.encoder_threshold
        return Verdict(quarantined=hit, reasons=reasons, score=rv.score, learned_score=p, encoder_score=q)


def parse_layers(text: str) -> tuple[str, ...]:
    """`"rules,learned"` -> ("rules", "learned"), in LAYERS order; ValueError names what is wrong.

    The encoder layer's packages are checked here (without loading the model), so a controller started
    with it but without `kvfleet[encoder]` installed stops at once with the fix, not on its first verdict.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(LAYERS))
    if not names or unknown:
        raise ValueError(f"detector layers {text!r}: name one or more of {', '.join(LAYERS)}"
                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    if "encoder" in names and (missing := missing_modules()):
        raise ValueError(f"the encoder layer needs {', '.join(missing)} ({INSTALL_HINT}); or leave it out: "
                         f"{','.join(n for n in LAYERS if n in names and n != 'encoder') or 'rules,learned'}")
    return tuple(n for n in LAYERS if n in names)


def parse_detector(text: str) -> DetectorConfig:
    """`"rules,learned:0.99,encoder:0.995"` -> the DetectorConfig: the layers (as `parse_layers`), each with
    an optional threshold after a colon (rules: the summed rule score, > 0; learned and encoder: P(injection)
    in [0, 1]; none given: the shipped threshold). ValueError names what is wrong."""
    names, thresholds = [], {}
    for item in (x.strip() for x in text.split(",")):
        name, sep, value = (x.strip() for x in item.partition(":"))
        names.append(name)
        if not sep or name not in LAYERS:
            continue
        try:
            t = float(value)
        except ValueError:
            raise ValueError(f"detector {text!r}: the {name} threshold {value!r} is not a number") from None
        if not math.isfinite(t) or (t <= 0 if name == "rules" else not 0.0 <= t <= 1.0):
            raise ValueError(f"detector {text!r}: the {name} threshold {t} must be "
                             + ("> 0" if name == "rules" else "in [0, 1]"))
        thresholds[name] = t
    layers = parse_layers(",".join(names))
    return DetectorConfig(layers=layers, rule_threshold=thresholds.get("rules", THRESHOLD),
                          learned_threshold=thresholds.get("learned"), encoder_threshold=thresholds.get("encoder"))


def make_detector(cfg: DetectorConfig | None = None) -> LayeredDetector:
    """The detector for `cfg` (default: the shipped layered policy)."""
    return LayeredDetector(cfg or DetectorConfig())


def _config_id(
    cfg: DetectorConfig,
    learned_threshold: float,
    model: LearnedModel | None,
    encoder_threshold: float,
    encoder: EncoderModel | None,
) -> str:
    """sha256 of the config, the effective thresholds and the models' weights: equal ids, equal verdicts."""
    doc = {
        "cfg": asdict(cfg),
        "learned_threshold": learned_threshold,
        "model": model.digest() if model else None,
        "encoder_threshold": encoder_threshold,
        "encoder": encoder.digest() if encoder else None,
    }
    return "det-" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]
