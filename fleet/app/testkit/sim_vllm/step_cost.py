"""What one engine step of the stand-in costs in modelled seconds, and a lone request's TTFT under it (pure).

The scheduler (sched.py) stamps each step with `CostModel.step_s`; an instant engine (no clock) observes
`lone_ttft_s` of a request's uncached tokens in its TTFT histogram (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """What one engine step costs, in modelled seconds (defaults and sources: docs/sim_vllm.md).

    step_s = step_overhead_s + max(decode_base_s, prefill_tokens / prefill_tokens_per_s)
             + decode_per_seq_s * decode_seqs

    NOTE: the max is a roofline: every forward pass reads all weights once (decode_base_s), and a
    prefill chunk costs more only once its compute exceeds that read.
    """

    step_overhead_s: float
    prefill_tokens_per_s: float
    decode_base_s: float
    decode_per_seq_s: float

    def __post_init__(self) -> None:
        assert self.prefill_tokens_per_s > 0
        assert min(self.step_overhead_s, self.decode_base_s, self.decode_per_seq_s) >= 0

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int) -> float:
        forward = max(self.decode_base_s, num_prefill_tokens / self.prefill_tokens_per_s)
        return self.step_overhead_s + forward + self.decode_per_seq_s * num_decode_seqs


def lone_ttft_s(cost: CostModel, max_num_batched_tokens: int, num_prefill_tokens: int) -> float:
    """TTFT of a request alone on the engine: its prefill in budget-sized chunks, one step each."""
    full, rest = divmod(num_prefill_tokens, max_num_batched_tokens)
    chunks = [max_num_batched_tokens] * full + ([rest] if rest else [])
    return sum(cost.step_s(n, 0) for n in chunks)
