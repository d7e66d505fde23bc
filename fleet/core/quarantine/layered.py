"""The layered detector: fast rules (layer 1), the learned n-gram classifier (layer 2) and the fine-tuned
encoder (layer 3), per-tenant config.

    rules   (rules.py, detector.py)  score >= rule_threshold  -> QUARANTINED, reasons = rule categories
    learned (learned.py)             P(injection) >= learned_threshold -> QUARANTINED, reason "learned:0.913"
    encoder (encoder.py)             any member's P(injection) >= its threshold -> QUARANTINED,
                                     reason "encoder:<member>:0.874" per member (ENCODER_MODELS: two runs)
                                     both read `unquoted_view`: quotations inside texts about attacks are blanked
    encoder_gate (optional)          the encoder runs only when the learned score >= encoder_gate; below it the
                                     encoder is not run and cannot quarantine (reason "encoder-gated:learned<0.5000")

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
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from fleet.core.quarantine import rules as R
from fleet.core.quarantine import text as T
from fleet.core.quarantine.detector import THRESHOLD, PromptInjectionDetector, Verdict, blank_quotations
from fleet.core.quarantine.encoder import (
    ENCODER_MODELS,
    INSTALL_HINT,
    EncoderModel,
    load_encoder,
    missing_modules,
)
from fleet.core.quarantine.learned import MODEL_NAME, LearnedModel, load_model

LAYERS = ("rules", "learned", "encoder")
# NOTE: the encoder is opt-in (issue #28): judged off the request path it still withholds benign text later, and
# it did so for 76 of 603 rows of the multilingual benign test part (12.6%; rules + learned: 0 of 603, and 0 of
# the routing bench's 1,704 agent tool results), at 0.1-0.6 s of CPU per KiB. docs/quarantine.md has the figures.
DEFAULT_LAYERS = ("rules", "learned")


def installed_layers(layers: Iterable[str]) -> tuple[str, ...]:
    """`layers` less those whose optional packages are not installed here (found without importing them), in
    LAYERS order. Only the encoder needs any (`pip install 'kvfleet[encoder]'`); every other layer is numpy."""
    names = set(layers)
    return tuple(n for n in LAYERS if n in names and not (n == "encoder" and missing_modules()))


def default_layers() -> tuple[str, ...]:
    """The layers that run when none are named: DEFAULT_LAYERS, less any not installed here, so that a plain
    install (no extras) judges with what it has. A layer named explicitly is checked by `parse_layers`."""
    return installed_layers(DEFAULT_LAYERS)


def layers_report(layers: Iterable[str], named: bool) -> str:
    """The controller's start line: the layers that run, whether they were named or are the default, and the
    one command or flag that adds each layer that does not run."""
    run = tuple(layers)
    missing = [n for n in LAYERS if n not in run and n not in installed_layers([n])]
    off = [n for n in LAYERS if n not in run and n not in missing]
    out = f"detector layers: {','.join(run)} ({'--detector-layers' if named else 'default'})"
    if missing:
        out += f"; not installed: {','.join(missing)} ({INSTALL_HINT} adds it)"
    if off:
        out += f"; installed, not enabled: {','.join(off)} (--detector-layers {','.join(n for n in LAYERS if n in run or n in off)})"
    return out


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """Which layers run and where their thresholds sit (one per tenant, defaults = shipped policy).

    Attributes:
        layers: the enabled layers, a non-empty subset of LAYERS (default: `default_layers()`, DEFAULT_LAYERS
            less any not installed; "encoder" needs `pip install 'kvfleet[encoder]'`, and
            `encoder.EncoderUnavailable` says so when it is named and missing).
        rule_threshold: the rules quarantine at this summed score.
        rule_categories: the rule set (None: every category in `rules.CATEGORIES`).
        learned_threshold: P(injection) at which the learned layer quarantines (None: the model's
            threshold, chosen on the validation split by `scripts/train_detector.py`).
        model: the shipped model's name under `fleet/core/quarantine/model/`.
        encoder_threshold: P(injection) at which an encoder member quarantines: one float for every
            member, or one per member (None: each member's shipped threshold, chosen on the validation split
            for the shipped committee; see docs/quarantine.md, round ten).
        encoder_models: the encoder layer's members, adapter folders under `fleet/core/quarantine/model/`; the
            layer quarantines when any member does (default: the two shipped runs).
        encoder_gate: a cascade (None: no gate): the encoder judges a text only when the learned layer's score
            (the 4-decimal P(injection) in the verdict) is >= this; below it the encoder does not run and
            cannot quarantine, and the controller queues no heavy job for the bytes. Needs the learned layer.
            docs/quarantine_default.md has the figures.
    """

    layers: tuple[str, ...] = field(default_factory=default_layers)
    rule_threshold: float = THRESHOLD
    rule_categories: tuple[str, ...] | None = None
    learned_threshold: float | None = None
    model: str = MODEL_NAME
    encoder_threshold: float | tuple[float, ...] | None = None
    encoder_models: tuple[str, ...] = ENCODER_MODELS
    encoder_gate: float | None = None

    def __post_init__(self) -> None:
        assert self.layers and set(self.layers) <= set(LAYERS), (
            f"layers must be a non-empty subset of {LAYERS}"
        )
        assert self.rule_threshold > 0, "rule_threshold must be > 0"
        assert self.learned_threshold is None or 0.0 <= self.learned_threshold <= 1.0, (
            "learned_threshold in [0, 1]"
        )
        assert self.encoder_models, "encoder_models: one member or more"
        t = self.encoder_threshold
        ts = () if t is None else t if isinstance(t, tuple) else (t,)
        assert all(0.0 <= x <= 1.0 for x in ts), "encoder_threshold in [0, 1]"
        assert not isinstance(t, tuple) or len(t) == len(self.encoder_models), (
            f"encoder_threshold: one per member ({len(self.encoder_models)}: {', '.join(self.encoder_models)})"
        )
        g = self.encoder_gate
        assert g is None or (isinstance(g, float | int) and 0.0 <= g <= 1.0), f"encoder_gate {g!r}: in [0, 1] or None"
        assert g is None or "learned" in self.layers, (
            "encoder_gate reads the learned layer's score: add 'learned' to layers, or set encoder_gate=None"
        )
        unknown = set(self.rule_categories or ()) - R.CATEGORIES
        assert not unknown, f"unknown rule categories {sorted(unknown)}; known: {sorted(R.CATEGORIES)}"


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
        ranker = self._ranker
        read: dict[tuple[int, int, int], list[list[int]]] = {}  # members that window alike tokenize and rank once
        for enc, threshold, name in zip(self.encoders, self.encoder_thresholds, self.member_names, strict=True):
            assert ranker is not None
            if enc.window_key not in read:
                read[enc.window_key] = enc.read_windows(view, rank=lambda s: float(np.max(ranker.window_logits(s))))
            qm = round(enc.score_windows(read[enc.window_key]), 4)
            reasons.append(f"encoder:{name}:{qm:.4f}")
            hit = hit or qm >= threshold
            q = qm if q is None else max(q, qm)
        return Verdict(quarantined=hit, reasons=reasons, score=rv.score, learned_score=p, encoder_score=q)


def gated_out(cfg: DetectorConfig, learned_score: float | None) -> bool:
    """Whether `cfg`'s encoder gate keeps the encoder from judging a text whose learned score is
    `learned_score` (the verdict's 4-decimal one): a gate is set and the score is below it."""
    return cfg.encoder_gate is not None and (learned_score is None or learned_score < cfg.encoder_gate)


def gate_reason(cfg: DetectorConfig) -> str:
    """The reason a verdict carries when the encoder gate kept the encoder from running."""
    assert cfg.encoder_gate is not None
    return f"encoder-gated:learned<{cfg.encoder_gate:.4f}"


def member_scores(v: Verdict) -> dict[str, float]:
    """{encoder member: its P(injection)} from a verdict's "encoder:<member>:<p>" reasons (empty: no encoder ran)."""
    return {m: float(p) for tag, m, p in (r.split(":") for r in v.reasons if r.count(":") == 2) if tag == "encoder"}


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
    in [0, 1]; none given: the shipped threshold). The encoder takes one threshold for every member or one
    per member, in ENCODER_MODELS order, joined by "/" ("encoder:0.9702/0.9764"). An item `gate:TAU` (not a
    layer) sets `encoder_gate`: the encoder judges only texts whose learned score is >= TAU (it needs both
    layers; docs/quarantine_default.md chose 0.918). ValueError names what is wrong."""
    names: list[str] = []
    thresholds: dict[str, tuple[float, ...]] = {}
    gate: float | None = None
    for item in (x.strip() for x in text.split(",")):
        name, sep, value = (x.strip() for x in item.partition(":"))
        if name == "gate":  # not a layer: the encoder's gate on the learned score (DetectorConfig.encoder_gate)
            gate = _threshold(text, "gate", value) if sep else None
            if gate is None:
                raise ValueError(f"detector {text!r}: gate needs a value, e.g. gate:0.918")
            continue
        names.append(name)
        if not sep or name not in LAYERS:
            continue
        parts = value.split("/")
        if len(parts) not in ((1, len(ENCODER_MODELS)) if name == "encoder" else (1,)):
            raise ValueError(f"detector {text!r}: {len(parts)} {name} thresholds; give one"
                             + (f" or {len(ENCODER_MODELS)} ({'/'.join(ENCODER_MODELS)})" if name == "encoder" else ""))
        thresholds[name] = tuple(_threshold(text, name, v) for v in parts)
    layers = parse_layers(",".join(names))
    if gate is not None and (problem := gate_problem(gate, layers)):
        raise ValueError(f"detector {text!r}: {problem}")
    enc = thresholds.get("encoder")
    return DetectorConfig(layers=layers, rule_threshold=thresholds.get("rules", (THRESHOLD,))[0],
                          learned_threshold=thresholds.get("learned", (None,))[0],
                          encoder_threshold=enc if enc is None or len(enc) > 1 else enc[0], encoder_gate=gate)


def gate_problem(gate: float, layers: tuple[str, ...]) -> str | None:
    """What is wrong with an encoder gate for these layers (None: nothing), in words a flag's error can carry."""
    if not math.isfinite(gate) or not 0.0 <= gate <= 1.0:
        return f"the gate {gate} must be a learned score in [0, 1], e.g. 0.918"
    if not {"learned", "encoder"} <= set(layers):
        return ("the gate reads the learned score to decide whether the encoder runs; name both layers "
                "(e.g. rules,learned,encoder) or leave the gate out")
    return None


def _threshold(text: str, name: str, value: str) -> float:
    """One threshold of `parse_detector`'s spec `text`, checked for layer `name`."""
    try:
        t = float(value)
    except ValueError:
        raise ValueError(f"detector {text!r}: the {name} threshold {value.strip()!r} is not a number") from None
    if not math.isfinite(t) or (t <= 0 if name == "rules" else not 0.0 <= t <= 1.0):
        raise ValueError(f"detector {text!r}: the {name} threshold {t} must be "
                         + ("> 0" if name == "rules" else "in [0, 1]"))
    return t


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
        # NOTE: an ungated config keeps the id it had before encoder_gate existed
        "cfg": {k: v for k, v in asdict(cfg).items() if k != "encoder_gate" or v is not None},
        "learned_threshold": learned_threshold,
        "model": model.digest() if model else None,
        "encoder_thresholds": list(encoder_thresholds),
        "encoders": [e.digest() for e in encoders],
    }
    return "det-" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]
