"""The stand-in engine: a real prefix cache with vLLM's block hashing, LRU eviction and hazards.

Hazards reproduced (DESIGN §3, reference §1): AllBlocksCleared is only *queued* by sleep,
reset, pause(clear_cache) and release, and published with the next engine step; requests to a
sleeping engine wait (hang) until wake; /pause abort|wait rejects with 503; /health stays 200;
restart empties the cache silently and the publisher's seq starts again at 0.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.sim_vllm import wire
from controller.vllm.hashing import HashConfig, chain, to_external


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
    loras: dict[str, str] = field(default_factory=dict)  # lora_name -> lora_path
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.num_blocks > 1


@dataclass(frozen=True, slots=True)
class StepResult:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_new_blocks: int


class SimEngine:
    """Scheduler + block pool of one DP rank. `publish(events)` sends one batch (sync)."""

    def __init__(self, cfg: SimEngineConfig, publish: Callable[[list[Any]], None]) -> None:
        self.cfg = cfg
        self._publish = publish
        self.hash_cfg = HashConfig(cfg.hash_algo, cfg.hash_seed, cfg.block_size)
        self.cache: OrderedDict[bytes, None] = OrderedDict()  # full digest -> (), LRU order
        self.pending: list[Any] = []
        self.sleeping_tags: set[str] = set()
        self.paused_by: str | None = None  # "sleep" | "pause" | None
        self.pause_mode = "abort"
        self.sleep_state = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        self.running = 0
        self.waiting = 0
        self.queries = 0
        self.hits = 0
        self.start_time = time.time()
        self.generation = 0
        self.sleep_ops: dict[str, int] = {}  # vllm:sleep_mode_operation_duration_seconds_count, lazily created
        self._serving = asyncio.Event()
        self._serving.set()

    # state
    def is_sleeping(self) -> bool:
        return self.paused_by is not None or bool(self.sleeping_tags)

    def _update_serving(self) -> None:
        if self.is_sleeping():
            self._serving.clear()
        else:
            self._serving.set()

    def _reset_cache(self) -> None:
        self.cache.clear()
        self.pending.append(wire.AllBlocksCleared())  # NOTE: queued, published with the next step

    # lifecycle verbs
    def sleep(self, level: int, mode: str) -> None:
        self.sleep_ops["sleep"] = self.sleep_ops.get("sleep", 0) + 1
        if self.sleeping_tags or self.paused_by == "sleep":
            return  # a second sleep while asleep is a logged no-op
        self.paused_by, self.pause_mode = "sleep", mode
        if level >= 1:
            self._reset_cache()
            self.sleeping_tags = {"weights", "kv_cache"}
        self.sleep_state = {"awake": 0, "weights_offloaded": int(level == 1), "discard_all": int(level == 2)}
        self._update_serving()

    def wake_up(self, tags: list[str] | None) -> bool:
        """Returns True when fully awake; partial wakes leave the engine asleep."""
        self.sleep_ops["wake"] = self.sleep_ops.get("wake", 0) + 1
        if tags is None:
            self.sleeping_tags.clear()
        else:
            self.sleeping_tags.difference_update(tags)
        if not self.sleeping_tags:
            if self.paused_by == "sleep":
                self.paused_by = None
            self.sleep_state = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        self._update_serving()
        return not self.is_sleeping()

    def pause(self, mode: str, clear_cache: bool) -> None:
        if self.paused_by is None:
            self.paused_by = "pause"
        self.pause_mode = mode
        if clear_cache and mode != "keep":
            self._reset_cache()
        self._update_serving()

    def resume(self) -> None:
        if self.paused_by == "pause":
            self.paused_by = None
        self._update_serving()

    def reset_prefix_cache(self) -> bool:
        if self.running or self.waiting:
            return False  # blocks are held by requests in flight: vLLM answers success:false
        self._reset_cache()
        return True

    def release_kv_cache_memory(self) -> bool:
        if self.paused_by is None or self.sleeping_tags:
            return False
        self._reset_cache()
        self.sleeping_tags = {"kv_cache"}
        self.sleep_state = {"awake": 0, "weights_offloaded": 0, "discard_all": 0}
        self._update_serving()
        return True

    def restart(self) -> None:
        """A fast process restart: empty cache, no event, fresh start time (seq reset is the publisher's)."""
        self.cache.clear()
        self.pending.clear()
        self.sleeping_tags.clear()
        self.paused_by = None
        self.sleep_state = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        self.start_time = time.time()
        self.sleep_ops = {}
        self.generation += 1
        self._update_serving()

    # requests
    async def run(self, token_ids: Sequence[int], *, lora: str | None = None, cache_salt: str | None = None,
                  report_full: bool = False) -> StepResult:
        """Admit a request (waiting while asleep), then run one engine step for its prompt."""
        if self.paused_by == "pause" and self.pause_mode in ("abort", "wait"):
            raise EnginePaused("engine_paused")
        gen = self.generation
        self.waiting += 1
        try:
            await self._serving.wait()
        finally:
            self.waiting -= 1
        if gen != self.generation:
            raise EngineRestarted("engine restarted while the request waited")
        self.running += 1
        try:
            return self._step(token_ids, lora, cache_salt, report_full)
        finally:
            self.running -= 1

    def _step(self, token_ids: Sequence[int], lora: str | None, salt: str | None, report_full: bool) -> StepResult:
        lora_kv = (lora, self.cfg.loras[lora]) if lora else None
        digests = chain(self.hash_cfg, token_ids, lora=lora_kv, cache_salt=salt)
        hit = 0
        while hit < len(digests) and digests[hit] in self.cache:
            hit += 1
        for d in digests[:hit]:
            self.cache.move_to_end(d)
        first_new = 0 if report_full else hit
        new = digests[hit:][: self.cfg.num_blocks - hit]
        self._evict(len(self.cache) + len(new) - self.cfg.num_blocks, keep=set(digests))
        for d in new:
            self.cache[d] = None
        stored = digests[first_new:hit + len(new)]
        if stored:
            self.pending.append(self._stored_event(token_ids, digests, first_new, len(stored), lora, salt))
        self.queries += len(token_ids)
        self.hits += hit * self.cfg.block_size
        self._flush()
        return StepResult(len(token_ids), hit * self.cfg.block_size, len(new))

    def _evict(self, n: int, keep: set[bytes]) -> None:
        for d in [d for d in self.cache if d not in keep][:max(n, 0)]:
            del self.cache[d]
            self.pending.append(wire.BlockRemoved(block_hashes=[to_external(d)], medium="GPU", group_idx=0))

    def _stored_event(self, token_ids: Sequence[int], digests: list[bytes], start: int, n: int,
                      lora: str | None, salt: str | None) -> wire.BlockStored:
        B = self.cfg.block_size
        extra: list[tuple[Any, ...] | None] = []
        for i in range(start, start + n):
            keys = ([lora] if lora else []) + ([salt] if salt is not None and i == 0 else [])
            extra.append(tuple(keys) or None)
        return wire.BlockStored(
            block_hashes=[to_external(d) for d in digests[start:start + n]],
            parent_block_hash=to_external(digests[start - 1]) if start > 0 else None,
            token_ids=list(token_ids[start * B:(start + n) * B]), block_size=B,
            lora_id=(sorted(self.cfg.loras).index(lora) + 1) if lora else None, medium="GPU",
            lora_name=lora, extra_keys=extra, group_idx=0, kv_cache_spec_kind="full_attention")

    def _flush(self) -> None:
        if self.pending:
            events, self.pending = self.pending, []
            self._publish(events)

    def resident_external(self) -> list[int]:
        """The TRUE resident hashes (64-bit, as events carry them), for oracle checks."""
        return [to_external(d) for d in self.cache]
