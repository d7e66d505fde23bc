"""The stand-in engine's options (`kvfleet sim-vllm`'s flags, named after vLLM's) and the errors its requests meet."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.app.testkit.sim_vllm.sched import POLICIES
from fleet.app.testkit.sim_vllm.step_cost import CostModel
from fleet.core.errors import InvalidArgument


class EnginePaused(Exception):
    """Raised for requests while paused with mode abort|wait (vLLM answers 503)."""


class EngineRestarted(Exception):
    """A request that was waiting when the engine restarted."""


@dataclass(slots=True)
class SimEngineConfig:
    model: str = "sim-model"
    block_size: int = 16
    num_blocks: int = 1024
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    # how a block's extra keys (LoRA, cache_salt) are hashed: "tagged" (the vLLM releases this project follows) or
    # "untagged" (releases before the tags: the plain strings the events publish); fleet/core/block_hash.py
    hash_extra_keys: str = "tagged"
    loras: dict[str, str] = field(default_factory=dict)  # lora_name -> lora_path
    # vLLM's --served-model-name: the names it answers to, each listed as a base model card (root: `model`); the
    # first is the one it answers with and fills in for a request without a model. None given: `model` alone
    served_model_names: tuple[str, ...] = ()
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and /v1/unload_lora_adapter change `loras`
    runtime_lora: bool = False
    max_model_len: int = 8192
    # the clock: vLLM's scheduler limits and a cost model of Llama-3.1-8B (BF16) on one H100 SXM.
    # A model, not a measurement: each figure and its source is in docs/sim_vllm.md.
    # NOTE: 0 (instant) here, for in-process harnesses (tests, the demo, whose offline model replays
    # `_step` and must match the live engine); `kvfleet sim-vllm` defaults to 1 (real time).
    time_scale: float = 0.0
    max_num_seqs: int = 1024  # vLLM's default on >=70 GiB GPUs (H100) for the API server
    max_num_batched_tokens: int = 8192  # ditto: the per-step token budget (chunked prefill)
    prefill_tokens_per_s: float = 15000.0
    step_overhead_s: float = 0.002
    decode_base_s: float = 0.008
    decode_per_seq_s: float = 0.00008
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs, or priority (a request's `priority`)

    def __post_init__(self) -> None:
        # NOTE: checks, not asserts: these are `kvfleet sim-vllm`'s flags (named after them), and python -O drops asserts
        for name, ok, rule in (
            ("block_size", self.block_size >= 1, "at least 1"),
            ("num_blocks", self.num_blocks >= 2, "at least 2"),
            ("max_model_len", self.max_model_len >= 1, "at least 1"),
            ("time_scale", self.time_scale >= 0, ">= 0 (0: instant answers)"),
            ("max_num_seqs", self.max_num_seqs >= 1, "at least 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "at least 1"),
            ("prefill_tokens_per_s", self.prefill_tokens_per_s > 0, "> 0"),
            ("step_overhead_s", self.step_overhead_s >= 0, ">= 0"),
            ("decode_base_s", self.decode_base_s >= 0, ">= 0"),
            ("decode_per_seq_s", self.decode_per_seq_s >= 0, ">= 0"),  # NaN fails each of these
            ("scheduling_policy", self.scheduling_policy in POLICIES, " or ".join(POLICIES)),
        ):
            if not ok:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """The names it serves its base model under (vLLM's served_model_names)."""
        return self.served_model_names or (self.model,)

    def cost_model(self) -> CostModel:
        return CostModel(
            self.step_overhead_s, self.prefill_tokens_per_s, self.decode_base_s, self.decode_per_seq_s
        )
