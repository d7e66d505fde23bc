"""Quarantine: one verdict, two media (DESIGN §7). Pure core: no ray, grpc, redis or zmq.

    from fleet.core.quarantine import default_detector, make_detector, DetectorConfig
    v = default_detector().inspect("tool result text")    # layer 1 (rules): v.quarantined, v.reasons, v.score
    v = make_detector(DetectorConfig()).inspect(data)      # the default layers installed here (detector_config.default_layers)
    make_detector(DetectorConfig(layers=("rules", "learned", "encoder")))  # named layers; "encoder:<member>:<p>"
    admit_tool_result(ctx, ref, store, tenant)             # default detector: make_detector() (layered)
    admit_tool_result(ctx, ref, store, tenant, verdict=v)  # a verdict reached elsewhere (the controller's Judge)
"""

from __future__ import annotations

from fleet.core.quarantine.admit import admit_tool_result, default_admission_detector
from fleet.core.quarantine.cache import VerdictCache
from fleet.core.quarantine.detector import Detector, PromptInjectionDetector, Verdict, default_detector
from fleet.core.quarantine.detector_config import DetectorConfig
from fleet.core.quarantine.layered import LayeredDetector, make_detector

__all__ = ["Detector", "DetectorConfig", "LayeredDetector", "PromptInjectionDetector", "Verdict",
           "VerdictCache", "admit_tool_result", "default_admission_detector", "default_detector", "make_detector"]
