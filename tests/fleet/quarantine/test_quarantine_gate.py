"""The encoder gate (issue #28): with `DetectorConfig(encoder_gate=tau)` the encoder judges a text only when the
learned layer's score is >= tau; below it the encoder is not run (its members are never called) and cannot
quarantine, and the verdict says it was gated out. The config id separates gated and ungated verdicts.

The members are the shipped ones, wrapped only to count their calls. Encoder threshold 0 makes the encoder
quarantine anything it judges, so a verdict shows whether it ran. Skipped without the encoder extra."""

from __future__ import annotations

from typing import Any

import pytest
from support.extras import require_encoder

require_encoder()

from fleet.core.errors import InvalidArgument  # noqa: E402
from fleet.core.quarantine import DetectorConfig  # noqa: E402
from fleet.core.quarantine.detector_config import parse_detector  # noqa: E402
from fleet.core.quarantine.encoder import ENCODER_MODELS, load_encoder  # noqa: E402
from fleet.core.quarantine.layered import LayeredDetector, member_scores  # noqa: E402

LOW = "Build 8812 passed: 412 tests, 0 failures, coverage 81.4%."  # learned 0.0037
MID = "Order 4412 shipped on 3 March via DHL, expected delivery Friday."  # learned 0.3692: clean for rules + learned
GATE = 0.1
ANY = DetectorConfig(layers=("rules", "learned", "encoder"), encoder_threshold=0.0)  # the encoder flags all it reads


class Counted:
    """A shipped encoder member that counts the texts it scores (everything else is the member's own)."""

    def __init__(self, member: Any) -> None:
        self.member, self.calls = member, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.member, name)

    def score_windows(self, windows: list[list[int]]) -> float:
        self.calls += 1
        return float(self.member.score_windows(windows))


def detector(cfg: DetectorConfig) -> tuple[LayeredDetector, list[Counted]]:
    members = [Counted(load_encoder(n)) for n in ENCODER_MODELS]
    return LayeredDetector(cfg, encoders=tuple(members)), members  # type: ignore[arg-type]


def calls(members: list[Counted]) -> int:
    return sum(m.calls for m in members)


def test_below_the_gate_the_encoder_never_runs_and_cannot_quarantine() -> None:
    det, members = detector(DetectorConfig(layers=ANY.layers, encoder_threshold=0.0, encoder_gate=GATE))
    low = det.inspect(LOW)
    assert calls(members) == 0  # never sent to the encoder
    assert not low.quarantined and low.encoder_score is None and member_scores(low) == {}
    assert low.learned_score is not None and low.learned_score < GATE
    assert f"encoder-gated:learned<{GATE:.4f}" in low.reasons
    mid = det.inspect(MID)  # at or above the gate: the encoder judges it (every member), as without a gate
    assert mid.learned_score is not None and mid.learned_score >= GATE
    assert calls(members) == len(ENCODER_MODELS)
    assert mid.quarantined and set(member_scores(mid)) == set(ENCODER_MODELS)
    assert not any(r.startswith("encoder-gated") for r in mid.reasons)


def test_control_without_a_gate_the_encoder_judges_the_low_text() -> None:
    det, members = detector(ANY)
    v = det.inspect(LOW)
    assert calls(members) == len(ENCODER_MODELS) and v.quarantined
    assert not any(r.startswith("encoder-gated") for r in v.reasons)


def test_the_gate_is_in_the_config_id_and_checked() -> None:
    ids = {LayeredDetector(DetectorConfig(layers=ANY.layers, encoder_gate=g)).config_id for g in (None, 0.1, 0.2)}
    assert len(ids) == 3
    with pytest.raises(InvalidArgument, match="encoder_gate"):
        DetectorConfig(layers=("rules", "encoder"), encoder_gate=0.5)  # no learned score to gate on
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidArgument, match="encoder_gate"):
            DetectorConfig(layers=ANY.layers, encoder_gate=bad)
    assert parse_detector("rules,learned,encoder").encoder_gate is None  # the specs name no gate: ungated


def test_a_spec_names_the_gate_and_a_bad_gate_is_refused() -> None:
    """`gate:TAU` in a detector spec (--detector-tenant) sets the gate; without both layers, without a value or
    outside [0, 1] it is refused with the fix named."""
    assert parse_detector("rules,learned,encoder,gate:0.918").encoder_gate == 0.918
    assert parse_detector("learned:0.99,encoder,gate:0").encoder_gate == 0.0
    for bad, msg in (("rules,learned,gate:0.9", "name both layers"), ("rules,encoder,gate:0.9", "name both layers"),
                     ("rules,learned,encoder,gate", "gate needs a value"),
                     ("rules,learned,encoder,gate:1.5", r"gate threshold 1.5 must be in \[0, 1\]"),
                     ("rules,learned,encoder,gate:x", "not a number")):
        with pytest.raises(ValueError, match=msg):
            parse_detector(bad)


def test_the_controller_flag_sets_the_gate_of_the_default_detector() -> None:
    """--detector-encoder-gate (env KVFLEET_DETECTOR_ENCODER_GATE) reaches the controller's config, and the
    judge's DetectorConfig; it needs the learned and encoder layers named."""
    from controller.main import config_from, parse_args
    from fleet.core.errors import InvalidArgument

    args = ["--detector-layers", "rules,learned,encoder", "--detector-encoder-gate", "0.918"]
    assert config_from(parse_args(args, {}), {}).detector_encoder_gate == 0.918
    env = {"KVFLEET_DETECTOR_LAYERS": "rules,learned,encoder", "KVFLEET_DETECTOR_ENCODER_GATE": "0.5"}
    assert config_from(parse_args([], env), env).detector_encoder_gate == 0.5
    assert config_from(parse_args(["--detector-layers", "rules,learned,encoder"], {}), {}).detector_encoder_gate is None
    with pytest.raises(InvalidArgument, match="--detector-encoder-gate 0.9: .*name both layers"):
        config_from(parse_args(["--detector-layers", "rules,learned", "--detector-encoder-gate", "0.9"], {}), {})
    with pytest.raises(InvalidArgument, match=r"--detector-encoder-gate 2: .*learned score in \[0, 1\]"):
        config_from(parse_args(args[:2] + ["--detector-encoder-gate", "2"], {}), {})
    with pytest.raises(SystemExit):  # argparse: "argument --detector-encoder-gate: invalid float value: 'x'"
        parse_args([], {"KVFLEET_DETECTOR_ENCODER_GATE": "x"})
