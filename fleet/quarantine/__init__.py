"""Quarantine: one verdict, two media (DESIGN §7). Pure core: no ray, grpc, redis or zmq.

    from fleet.quarantine import default_detector
    v = default_detector().inspect("tool result text")    # v.quarantined, v.reasons, v.score
"""

from __future__ import annotations

from fleet.quarantine.admit import Admission, admit_tool_result
from fleet.quarantine.detector import Detector, PromptInjectionDetector, Verdict, default_detector

__all__ = ["Admission", "Detector", "PromptInjectionDetector", "Verdict", "admit_tool_result", "default_detector"]
