"""The exact per-session KV kernel: a Llama-family decoder with a paged, copy-on-write KV cache.

Pure core: imports no ray, grpc, redis or zmq. See docs/kernel.md for the exactness contract.
"""

from __future__ import annotations

from fleet.core.kernel.config import SUPPORTED_ARCHITECTURES, ModelConfig
from fleet.core.kernel.inputs import EVICT_MODES
from fleet.core.kernel.kernel import BACKENDS, Kernel
from fleet.core.kernel.session import Session
from fleet.core.kernel.tokenizer import ByteTokenizer
from fleet.core.kernel.types import EvictReport, MemoryReport, PrefixKV, max_abs_delta

__all__ = [
    "BACKENDS",
    "EVICT_MODES",
    "SUPPORTED_ARCHITECTURES",
    "ByteTokenizer",
    "EvictReport",
    "Kernel",
    "MemoryReport",
    "ModelConfig",
    "PrefixKV",
    "Session",
    "max_abs_delta",
]
