"""The stand-in's /metrics: vLLM's series, names, labels and buckets (vllm/v1/metrics/loggers.py).

Timing series are in *modelled* seconds (fleet/app/testkit/sim_vllm/sched.py): `time_scale` sets how fast
the sim plays the model out, never what the metrics say.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from fleet.app.testkit.sim_vllm.engine import SimEngine

# vLLM's vllm:time_to_first_token_seconds buckets (PrometheusStatLogger, unchanged from 0.6 to 0.33).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram: per-bucket counts (le semantics: v <= bound), then +Inf."""

    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        assert list(self.buckets) == sorted(self.buckets)
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.total += v

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of observations <= le), +Inf last, as the exposition writes them."""
        out, n = [], 0
        for le, c in zip([*map(floatToGoString, self.buckets), "+Inf"], self.counts, strict=True):
            n += c
            out.append((le, n))
        return out


def _family(name: str, typ: str, doc: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} {doc}", f"# TYPE {name} {typ}", *samples]


def _histogram(name: str, doc: str, lab: str, h: Histogram) -> list[str]:
    rows = [f'{name}_bucket{{{lab},le="{le}"}} {float(n)}' for le, n in h.cumulative()]
    rows += [f"{name}_count{{{lab}}} {float(h.count)}", f"{name}_sum{{{lab}}} {h.total}"]
    return _family(name, "histogram", doc, rows)


def metrics_text(e: SimEngine, dp_rank: int = 0) -> str:
    """Prometheus text: the vLLM series a router reads, labelled as vLLM labels them (engine: the global DP rank)."""
    c, st = e.cfg, e.sched.stats
    lab = f'engine="{dp_rank}",model_name="{c.names[0]}"'  # vLLM's served_model_name (review finding: was --model)

    def one(name: str, typ: str, doc: str, v: float) -> list[str]:
        return _family(name, typ, doc, [f"{name}{{{lab}}} {float(v)}"])

    lines = _family(
        "vllm:engine_sleep_state",
        "gauge",
        "Engine sleep state",
        [f'vllm:engine_sleep_state{{{lab},sleep_state="{k}"}} {float(v)}' for k, v in e.sleep_state.items()],
    )
    lines += one(
        "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", e.running
    )
    lines += one(
        "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", e.waiting
    )
    lines += one(
        "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage()
    )
    lines += one(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        e.queries,
    )
    lines += one(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        e.hits,
    )
    lines += one(
        "sim:preempted_prefill_tokens_total",
        "counter",
        "Stand-in only (vLLM has no such series): prompt tokens computed again when a preempted request was "
        "scheduled again, less its prefix-cache hits; vllm:prefix_cache_queries_total counts a request once.",
        e.preempted_prefill,
    )
    lines += one(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        st.num_preemptions,
    )
    lines += one(
        "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", st.num_prompt_tokens
    )
    lines += one(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        st.num_generation_tokens,
    )
    lines += _histogram(
        "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", lab, st.ttft
    )
    # NOTE: an info gauge without model_name, one label per CacheConfig field (a few of them here).
    info = (
        f'block_size="{c.block_size}",cache_dtype="auto",enable_prefix_caching="True",engine="{dp_rank}",'
        f'num_gpu_blocks="{c.num_blocks}",prefix_caching_hash_algo="{c.hash_algo}"'
    )
    lines += _family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        [f"vllm:cache_config_info{{{info}}} 1.0"],
    )
    lines += ["# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {e.start_time}"]
    lines += _sleep_mode(e)
    return "\n".join(lines) + "\n"


def _sleep_mode(e: SimEngine) -> list[str]:
    """vLLM's sleep-mode families (fleet/app/testkit/sim_vllm/sleep_ops.py): created on the first sleep-mode call,
    so absent before it (absent != 0), and labelled by `operation` alone, as vLLM's frontend labels them."""
    ops = e.ops
    if not ops.in_flight:
        return []
    name = "vllm:sleep_mode_operations_in_flight"
    lines = _family(name, "gauge", "Sleep-mode operations currently awaited.",
                    [f'{name}{{operation="{op}"}} {float(n)}' for op, n in ops.in_flight.items()])
    name = "vllm:sleep_mode_operation_duration_seconds"
    rows: list[str] = []
    for op, n in sorted(ops.done.items()):
        ol = f'operation="{op}"'
        rows += [f'{name}_bucket{{{ol},le="+Inf"}} {float(n)}', f"{name}_count{{{ol}}} {float(n)}",
                 f"{name}_sum{{{ol}}} {ops.total_s[op]}"]
    return lines + _family(name, "histogram", "Duration of one sleep-mode operation.", rows)
