"""Issue #28: a tenant whose config gates the encoder (`encoder_gate`) gets no heavy job for bytes the learned
layer scores below the gate: the fast verdict is final and says the encoder was gated out. Bytes at or above it
are queued for the encoder as before. A real Judge on a SQLite store with the shipped models; the encoder at
threshold 0 quarantines anything it judges, so a full verdict shows whether it ran. The controller's own
heavy-job path (judge_now -> judge_later) is covered end to end in test_judge_late.py."""

from __future__ import annotations

from pathlib import Path

from support.extras import require_encoder

from controller.verdicts import Judge
from fleet.cas import open_store
from fleet.core.quarantine.detector_config import DetectorConfig

require_encoder()

LOW = b"Build 8812 passed: 412 tests, 0 failures, coverage 81.4%."  # learned 0.0037
MID = b"Order 4412 shipped on 3 March via DHL, expected delivery Friday."  # learned 0.3692, clean for the fast layers
LAYERS = ("rules", "learned", "encoder")


def test_bytes_under_the_gate_queue_no_heavy_job(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'kv.db'}")
    gated = DetectorConfig(layers=LAYERS, encoder_threshold=0.0, encoder_gate=0.1)
    plain = DetectorConfig(layers=LAYERS, encoder_threshold=0.0)  # control: the same config, no gate
    j = Judge(store, tenants={"acme": gated, "bravo": plain})
    low, later = j.now(LOW, "acme")
    assert (low.quarantined, later) == (False, False)  # final: nothing to queue
    assert "encoder-gated:learned<0.1000" in low.reasons
    assert j.heavy(LOW, "acme").quarantined is False  # the full verdict agrees: the encoder did not run
    mid, later = j.now(MID, "acme")
    assert (mid.quarantined, later) == (False, True)  # above the gate: the encoder's verdict comes later
    assert j.heavy(MID, "acme").quarantined and j.now(MID, "acme")[0].quarantined
    # control: without the gate the low bytes go to the encoder too, which quarantines them
    _, later = j.now(LOW, "bravo")
    assert later and j.heavy(LOW, "bravo").quarantined
    # one fast verdict space for both (the gate does not change the fast verdict), separate full ones
    assert j.fast_for("acme") is j.fast_for("bravo") and j.config_id_for("acme") != j.config_id_for("bravo")
    store.close()
