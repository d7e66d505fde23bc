"""aiohttp client for one vLLM server: the reconcile reads and the lifecycle verbs.

Everything a worker answers is treated as untrusted: a non-2xx status, a body that is not the
expected JSON shape, or a timeout raises `WorkerHttpError` (an Unavailable), and the caller
fails closed (the worker is not serving and not warm).
"""

from __future__ import annotations

import codecs
import json
import math
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from fleet.core.errors import Unavailable

# The sleep-mode operations that can drop the KV cache, counted together between looks. NOTE: only "sleep" was: a
# release (which discards the cache and shows as sleep level 0) and a wake between two looks went unseen, and the
# worker was routed WARM to an empty cache until its next step (review finding)
CACHE_DROPPING_OPS = ("sleep", "release_kv_cache_memory")


class WorkerHttpError(Unavailable):
    """The worker did not answer, or answered something that is not vLLM's contract."""


class WorkerRefused(WorkerHttpError):
    """The worker answered HTTP 4xx: it refused the call as sent, in its state (vLLM's 400 for a
    /release_kv_cache_memory with no completed pause). FAILED_PRECONDITION, not UNAVAILABLE: asked again, it refuses
    again. NOTE: it was UNAVAILABLE, and the SDK sent a refused release 8 times over 9 s, each one taking the worker
    out of routing and dropping its index (review finding)."""

    code = "FAILED_PRECONDITION"


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """What /metrics says about one engine (DP rank: vLLM's `engine` label). None = series absent."""

    sleep_state: dict[str, float] = field(default_factory=dict)
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    start_time: float | None = None
    in_flight: float = 0.0
    sleep_ops: float | None = None  # count of /sleep and /release_kv_cache_memory operations (CACHE_DROPPING_OPS;
                                    # the histogram is created on first use)
    num_gpu_blocks: int | None = None  # KV pool size, vllm:cache_config_info{num_gpu_blocks} (None: absent)
    hash_algo: str | None = None  # vllm:cache_config_info{prefix_caching_hash_algo} (None: absent)
    prefix_hits: float | None = None  # vllm:prefix_cache_hits_total: prompt tokens found cached (None: absent)

    @property
    def awake(self) -> float | None:
        return self.sleep_state.get("awake")


LOAD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
# the series parse_metrics reads (a histogram's: its _count), and the families they belong to
SAMPLES = frozenset((
    "process_start_time_seconds", "vllm:engine_sleep_state", "vllm:cache_config_info",
    "vllm:sleep_mode_operation_duration_seconds_count", "vllm:sleep_mode_operations_in_flight", *LOAD_GAUGES,
    "vllm:prefix_cache_hits_total",
))
FAMILIES = SAMPLES | {"vllm:sleep_mode_operation_duration_seconds", "vllm:prefix_cache_hits"}
_NAME_START = frozenset(string.ascii_letters + "_:")


def wanted_lines(text: str) -> str:
    """Only the lines of SAMPLES and their families' # HELP / # TYPE, for the Prometheus parser.

    NOTE: the reconcile reads /metrics on the event loop every `reconcile_interval_s` per worker, and
    prometheus_client's parser takes about 17 us a line on the project machine: 1.1 ms for the stand-in's 61
    lines, and a vLLM server exports hundreds (a histogram line per bucket), each parse a pause of every route
    in flight. Filtering first costs a split per line. A line that cannot begin a metric name (HTML, say) is
    still an error (ValueError), as the parser would have said.
    """
    out: list[str] = []
    for i, line in enumerate(text.splitlines()):
        if not line or line.isspace():
            continue
        if line[0] == "#":
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in FAMILIES:
                out.append(line)
            continue
        if line[0] not in _NAME_START or " " not in line:
            raise ValueError(f"line {i + 1} is {line[:60]!r}")
        end = line.find("{")
        name = line[:end] if end >= 0 else line.split(None, 1)[0]
        if name in SAMPLES:
            out.append(line)
    return "\n".join(out) + "\n"


def parse_metrics(text: str, engine: str = "0") -> WorkerMetrics:
    """Parse Prometheus text (the lines it reads: wanted_lines) for one engine (`engine` label, the DP rank);
    vllm:engine_sleep_state is three series, filtered by label."""
    return _fold(_families(text), engine)


def parse_engines(text: str, engines: Sequence[int]) -> tuple[WorkerMetrics, ...]:
    """One WorkerMetrics per engine of `engines` (global DP ranks), in that order, the text parsed once.

    vLLM's API server exports every DP engine it runs, each labelled engine="<global rank>" (reference §4: an
    external-LB server of rank 3 labels its one engine "3"); an engine whose series are absent reads as idle
    (the defaults)."""
    families = _families(text)
    return tuple(_fold(families, str(e)) for e in engines)


def _families(text: str) -> list[Metric]:
    try:
        return list(text_string_to_metric_families(wanted_lines(text)))
    except Exception as e:
        raise WorkerHttpError(f"/metrics is not Prometheus text: {e}") from e


def _fold(families: list[Metric], engine: str) -> WorkerMetrics:
    """The samples of `engine` (and the unlabelled ones) as one WorkerMetrics."""
    sleep: dict[str, float] = {}
    vals: dict[str, float] = {}
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    hash_algo: str | None = None
    start: float | None = None
    in_flight = 0.0
    sleep_ops: float | None = None
    hits: float | None = None
    for fam in families:
        for s in fam.samples:
            if not (math.isfinite(s.value) and s.value >= 0):  # NOTE: a NaN load failed every route's reconcile
                raise WorkerHttpError(f"/metrics: {s.name} is {s.value}, not a finite value >= 0")
            eng = s.labels.get("engine")
            if s.name == "process_start_time_seconds":
                start = s.value
            if eng is not None and eng != engine:
                continue
            if s.name == "vllm:engine_sleep_state":
                sleep[s.labels.get("sleep_state", "")] = s.value
            elif s.name == "vllm:cache_config_info":
                block_size = _label_int(s.labels, "block_size", block_size)
                num_gpu_blocks = _label_int(s.labels, "num_gpu_blocks", num_gpu_blocks)
                hash_algo = s.labels.get("prefix_caching_hash_algo") or hash_algo
            elif (
                s.name == "vllm:sleep_mode_operation_duration_seconds_count"
                and s.labels.get("operation") in CACHE_DROPPING_OPS
            ):
                sleep_ops = (sleep_ops or 0.0) + s.value
            elif s.name == "vllm:sleep_mode_operations_in_flight":
                in_flight += s.value
            elif s.name == "vllm:prefix_cache_hits_total":
                hits = (hits or 0.0) + s.value
            elif s.name in LOAD_GAUGES:
                vals[s.name] = s.value
    return WorkerMetrics(
        sleep,
        vals.get("vllm:num_requests_running", 0.0),
        vals.get("vllm:num_requests_waiting", 0.0),
        vals.get("vllm:kv_cache_usage_perc", 0.0),
        block_size,
        start,
        in_flight,
        sleep_ops,
        num_gpu_blocks,
        hash_algo,
        hits,
    )


def _label_int(labels: dict[str, str], name: str, default: int | None) -> int | None:
    """A positive int label of an info metric; vLLM writes "None" for unset config (then: default)."""
    v = labels.get(name)
    return int(v) if v is not None and v.isdigit() and int(v) > 0 else default


MAX_ANSWER_BYTES = 16 << 20  # the most of one worker answer read (a vLLM /metrics is well under 1 MiB)


async def read_capped(r: aiohttp.ClientResponse, limit: int) -> bytearray | None:
    """A worker answer's body, or None once it passes `limit` bytes (read no further)."""
    raw = bytearray()
    async for chunk in r.content.iter_chunked(1 << 16):
        raw += chunk
        if len(raw) > limit:
            return None
    return raw


def _codec(charset: str | None) -> str:
    """The answer's charset, or UTF-8 when it names none or one Python lacks (as aiohttp's text() did)."""
    try:
        return codecs.lookup(charset).name if charset else "utf-8"
    except LookupError:
        return "utf-8"


class VllmHttp:
    """One worker's HTTP surface. The session is shared and owned by the caller."""

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def request(self, method: str, path: str, params: Any = None, *,
                      timeout_s: float | None = None) -> tuple[int, str]:
        """(status, body text); a body over MAX_ANSWER_BYTES is junk, read no further (memory per look bounded).
        `timeout_s`: this call's bound, where it is not the worker's usual one."""
        timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self.session.request(
                method, self.url + path, params=params, timeout=timeout
            ) as r:
                raw = await read_capped(r, MAX_ANSWER_BYTES)
                if raw is None:
                    raise WorkerHttpError(f"{self.url}{path}: answer over {MAX_ANSWER_BYTES} bytes")
                return r.status, raw.decode(_codec(r.charset))
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as e:
            raise WorkerHttpError(f"{self.url}{path}: {type(e).__name__}: {e}") from e

    async def json(self, method: str, path: str, params: Any = None, *, empty_ok: bool = False,
                   timeout_s: float | None = None) -> Any:
        status, text = await self.request(method, path, params, timeout_s=timeout_s)
        if not 200 <= status < 300:
            cls = WorkerRefused if 400 <= status < 500 else WorkerHttpError
            raise cls(f"{self.url}{path} answered HTTP {status}: {text[:200]}")
        if empty_ok and not text.strip():
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise WorkerHttpError(f"{self.url}{path} answered non-JSON: {text[:80]!r}") from e

    async def is_sleeping(self) -> bool:
        body = await self.json("GET", "/is_sleeping")
        if not isinstance(body, dict) or not isinstance(body.get("is_sleeping"), bool):
            raise WorkerHttpError(f"{self.url}/is_sleeping: unexpected body {str(body)[:80]}")
        return bool(body["is_sleeping"])

    async def metrics(self, engine: int = 0) -> WorkerMetrics:
        return parse_metrics(await self._metrics_text(), str(engine))

    async def engine_metrics(self, engines: Sequence[int]) -> tuple[WorkerMetrics, ...]:
        """Each DP engine's series from one /metrics answer (parse_engines)."""
        return parse_engines(await self._metrics_text(), engines)

    async def _metrics_text(self) -> str:
        status, text = await self.request("GET", "/metrics")
        if status != 200:
            raise WorkerHttpError(f"{self.url}/metrics answered HTTP {status}")
        return text

    async def health(self) -> bool:
        status, _ = await self.request("GET", "/health")
        return status == 200

    async def version(self) -> str:
        body = await self.json("GET", "/version")
        if not isinstance(body, dict) or not isinstance(body.get("version"), str):
            raise WorkerHttpError(f"{self.url}/version: unexpected body {str(body)[:80]}")
        return str(body["version"])

    async def loras(self) -> dict[str, str]:
        """The LoRA adapters /v1/models lists: id -> root (the adapter path the hash needs).

        vLLM lists an adapter as a card with a parent (its base model's first served name), and each of its
        --served-model-name names as a card with parent null. NOTE: every card but the registered model's was taken
        for an adapter, so an alias was hashed as a LoRA (never warm) and named one in the router's errors."""
        body = await self.json("GET", "/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise WorkerHttpError(f"{self.url}/v1/models: unexpected body {str(body)[:80]}")
        return {
            str(c["id"]): str(c.get("root") or c["id"]) for c in data
            if isinstance(c, dict) and "id" in c and c.get("parent")
        }

    async def server_info(self) -> dict[str, Any]:
        """block_size and prefix_caching_hash_algo, when /server_info exposes them."""
        body = await self.json("GET", "/server_info", {"config_format": "json"})
        text = json.dumps(body)
        out: dict[str, Any] = {}
        m = re.search(r'"?block_size"?\s*[:=]\s*(\d+)', text)
        if m:
            out["block_size"] = int(m.group(1))
        m = re.search(r'"?prefix_caching_hash_algo"?\s*[:=]\s*"?([a-z0-9_]+)', text)
        if m:
            out["hash_algo"] = m.group(1)
        return out


async def worker_hash_settings(http: VllmHttp) -> dict[str, Any]:
    """What the worker says about its block hashing: `hash_algo`, `block_size` (either may be absent).

    /server_info (dev mode) first, then the vllm:cache_config_info labels of /metrics (always served).
    An unreachable worker gives {} (the caller keeps its spec; self-calibration still checks it).
    """
    out: dict[str, Any] = {}
    try:
        out = await http.server_info()
    except WorkerHttpError:
        pass
    if "hash_algo" in out and "block_size" in out:
        return out
    try:
        m = await http.metrics()
    except WorkerHttpError:
        return out
    if m.hash_algo and "hash_algo" not in out:
        out["hash_algo"] = m.hash_algo
    if m.block_size and "block_size" not in out:
        out["block_size"] = m.block_size
    return out
