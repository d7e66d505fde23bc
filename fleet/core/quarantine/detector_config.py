"""The quarantine detector's configuration: which layers run (those installed here by default), their thresholds,
and the `--detector-layers` / `--detector-tenant` specs that name them (fleet/core/quarantine/layered.py runs them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleet.core.errors import InvalidArgument
from fleet.core.quarantine import rules as R
from fleet.core.quarantine.detector import THRESHOLD
from fleet.core.quarantine.encoder import ENCODER_MODELS, INSTALL_HINT, missing_modules
from fleet.core.quarantine.learned import MODEL_NAME

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
        encoder_max_fragmentation: a gate per window (None: none): an encoder window counts only if at most this
            share of its tokens are word-piece continuations or [UNK] (`EncoderModel.fragmentation`): the
            encoder judges text in the language it learned (English), not text its tokenizer cuts into pieces
            (other languages, base64, hex). A text none of whose windows pass is not read by the encoder. Needs
            the encoder layer. 0.2 was chosen on validation (docs/quarantine_default.md).
    """

    layers: tuple[str, ...] = field(default_factory=default_layers)
    rule_threshold: float = THRESHOLD
    rule_categories: tuple[str, ...] | None = None
    learned_threshold: float | None = None
    model: str = MODEL_NAME
    encoder_threshold: float | tuple[float, ...] | None = None
    encoder_models: tuple[str, ...] = ENCODER_MODELS
    encoder_gate: float | None = None
    encoder_max_fragmentation: float | None = None

    def __post_init__(self) -> None:
        # NOTE: these were asserts: `python -O` drops them, and a bad config from a library caller ran unchecked
        t, g, f = self.encoder_threshold, self.encoder_gate, self.encoder_max_fragmentation
        frag_problem = None if f is None else fragmentation_problem(f, self.layers)
        ts = () if t is None else t if isinstance(t, tuple) else (t,)
        unknown = set(self.rule_categories or ()) - R.CATEGORIES
        for ok, why in (
            (bool(self.layers) and set(self.layers) <= set(LAYERS),
             f"layers must be a non-empty subset of {LAYERS}, got {self.layers!r}"),
            (self.rule_threshold > 0, f"rule_threshold must be > 0, got {self.rule_threshold!r}"),
            (self.learned_threshold is None or 0.0 <= self.learned_threshold <= 1.0,
             f"learned_threshold must be in [0, 1], got {self.learned_threshold!r}"),
            (bool(self.encoder_models), "encoder_models: one member or more"),
            (all(0.0 <= x <= 1.0 for x in ts), f"encoder_threshold must be in [0, 1], got {t!r}"),
            (not isinstance(t, tuple) or len(t) == len(self.encoder_models),
             f"encoder_threshold: one per member ({len(self.encoder_models)}: {', '.join(self.encoder_models)})"),
            (g is None or (isinstance(g, float | int) and 0.0 <= g <= 1.0), f"encoder_gate {g!r}: in [0, 1] or None"),
            (g is None or "learned" in self.layers,
             "encoder_gate reads the learned layer's score: add 'learned' to layers, or set encoder_gate=None"),
            (frag_problem is None, f"encoder_max_fragmentation {f!r}: {frag_problem}"),
            (not unknown, f"unknown rule categories {sorted(unknown)}; known: {sorted(R.CATEGORIES)}"),
        ):
            if not ok:
                raise InvalidArgument(why)


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


GATE_EXAMPLES = {"gate": "0.918", "frag": "0.2"}  # a spec's gate items, each with the value chosen on validation


def parse_detector(text: str) -> DetectorConfig:
    """`"rules,learned:0.99,encoder:0.995"` -> the DetectorConfig: the layers (as `parse_layers`), each with
    an optional threshold after a colon (rules: the summed rule score, > 0; learned and encoder: P(injection)
    in [0, 1]; none given: the shipped threshold). The encoder takes one threshold for every member or one
    per member, in ENCODER_MODELS order, joined by "/" ("encoder:0.9702/0.9764"). An item `gate:TAU` (not a
    layer) sets `encoder_gate`: the encoder judges only texts whose learned score is >= TAU (it needs both
    layers; docs/quarantine_default.md chose 0.918). An item `frag:PHI` sets `encoder_max_fragmentation`: an
    encoder window counts only if at most PHI of its tokens are word pieces (it needs the encoder; 0.2 was
    chosen there). ValueError names what is wrong."""
    names: list[str] = []
    thresholds: dict[str, tuple[float, ...]] = {}
    gates: dict[str, float] = {}  # not layers: the encoder's gates, gate (encoder_gate), frag (encoder_max_fragmentation)
    for item in (x.strip() for x in text.split(",")):
        name, sep, value = (x.strip() for x in item.partition(":"))
        if name in GATE_EXAMPLES:
            if not sep:
                raise ValueError(f"detector {text!r}: {name} needs a value, e.g. {name}:{GATE_EXAMPLES[name]}")
            gates[name] = _threshold(text, name, value)
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
    gate, frag = gates.get("gate"), gates.get("frag")
    if gate is not None and (problem := gate_problem(gate, layers)):
        raise ValueError(f"detector {text!r}: {problem}")
    if frag is not None and (problem := fragmentation_problem(frag, layers)):
        raise ValueError(f"detector {text!r}: {problem}")
    enc = thresholds.get("encoder")
    return DetectorConfig(layers=layers, rule_threshold=thresholds.get("rules", (THRESHOLD,))[0],
                          learned_threshold=thresholds.get("learned", (None,))[0],
                          encoder_threshold=enc if enc is None or len(enc) > 1 else enc[0], encoder_gate=gate,
                          encoder_max_fragmentation=frag)


def gate_problem(gate: float, layers: tuple[str, ...]) -> str | None:
    """What is wrong with an encoder gate for these layers (None: nothing), in words a flag's error can carry."""
    if not math.isfinite(gate) or not 0.0 <= gate <= 1.0:
        return f"the gate {gate} must be a learned score in [0, 1], e.g. 0.918"
    if not {"learned", "encoder"} <= set(layers):
        return ("the gate reads the learned score to decide whether the encoder runs; name both layers "
                "(e.g. rules,learned,encoder) or leave the gate out")
    return None


def fragmentation_problem(frag: float, layers: tuple[str, ...]) -> str | None:
    """What is wrong with an encoder window gate for these layers (None: nothing), in words a flag's error can carry."""
    if isinstance(frag, bool) or not isinstance(frag, float | int) or not math.isfinite(frag) or not 0.0 < frag <= 1.0:
        return f"the fragmentation {frag} must be a share of a window's tokens in (0, 1], e.g. 0.2"
    if "encoder" not in layers:
        return "the fragmentation gate decides which windows the encoder reads; name the encoder layer or leave it out"
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
