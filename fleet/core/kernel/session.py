"""A session: one agent's token sequence and its paged KV cache, with exact prefix reuse,
span eviction, copy-on-write forks and block-aligned prefix export."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.core.kernel.cache import PagedKV
from fleet.core.kernel.deltas import layer0_delta, rope_delta
from fleet.core.kernel.forward import run_tiles
from fleet.core.kernel.inputs import as_int, check_count, check_ids, check_range, check_span
from fleet.core.kernel.types import K_POST, K_RAW, EvictReport, MemoryReport, PrefixKV

if TYPE_CHECKING:
    from fleet.core.kernel.kernel import Kernel


class Session:
    """Token ids, positions (always 0..n-1) and the KV cache of one sequence. Create with
    `Kernel.session()`. Not thread-safe: one caller at a time (one Ray actor per session)."""

    def __init__(self, kernel: Kernel, kv: PagedKV, tokens: list[int], last_logits: np.ndarray | None = None,
                 num_exact_tokens: int | None = None):
        self.kernel = kernel
        self._kv = kv
        self._tokens = tokens
        self._last = last_logits
        self.num_computed = 0  # tokens this object ran through the model (appends, exact-evict survivors, decode)
        # positions [0, n) whose K/Kraw/V are what a prefill of their token ids stores (see num_exact_tokens)
        self._exact_upto = len(tokens) if num_exact_tokens is None else num_exact_tokens

    # -- state --
    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def positions(self) -> list[int]:
        return list(range(len(self._tokens)))

    @property
    def last_logits(self) -> np.ndarray | None:
        return None if self._last is None else self._last.copy()

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def num_exact_tokens(self) -> int:
        """How many leading positions hold bit for bit what a prefill of their token ids stores (== len(self)
        unless a `reposition` on a deep model left survivors whose layer >= 1 KV carries the evicted span).

        NOTE: an `exact` eviction recomputes the survivors from the positions before the span; when those still
        carry an earlier reposition's span, so do the survivors (they attend to them). Its report said exact=True
        while its cache differed from never-saw's (max|d logits| 0.2 on the tiny model; found by review).
        """
        return self._exact_upto

    # -- append --
    def append(self, ids: Any) -> np.ndarray:
        """Prefill (or decode) `ids` after the current tokens.

        Args:
            ids: 1-D sequence of integer token ids in [0, vocab_size).

        Returns:
            float32 [vocab] next-token logits after the last appended token; bit-identical however
            the same tokens were split across calls (batch-invariant tiles).

        Raises:
            InvalidArgument: empty, non-integer or out-of-vocabulary ids (cache unchanged).
            ResourceExhausted: the sequence would exceed the model's context (cache unchanged).
        """
        arr = check_ids(ids, self.kernel.config, len(self._tokens))
        logits = self._forward(arr, len(self._tokens))
        self._tokens.extend(int(i) for i in arr)
        self._last = logits
        return logits.copy()

    def check_append(self, ids: Any) -> None:
        """Raise exactly what `append(ids)` would raise for bad or overflowing input, appending
        nothing (callers that log an op before applying it validate with this first).

        Raises:
            InvalidArgument: empty, non-integer or out-of-vocabulary ids.
            ResourceExhausted: the sequence would exceed the model's context.
        """
        check_ids(ids, self.kernel.config, len(self._tokens))

    def _forward(self, ids: np.ndarray, p0: int) -> np.ndarray:
        """Run tokens `ids` at positions [p0, p0+n) (fleet/core/kernel/forward.py `run_tiles`: all or nothing),
        count them, and return logits after the last one. The caller updates the tokens."""
        logits = run_tiles(self.kernel, self._kv, ids, p0)
        self.num_computed += len(ids)
        # [p0, p1) attended to [0, p0): exactly a prefill's when that prefix is; positions past p1 are gone
        self._exact_upto = p0 + len(ids) if self._exact_upto >= p0 else self._exact_upto
        return logits

    def _truncate(self, n: int) -> None:
        self._kv.truncate(n)
        del self._tokens[n:]
        self._exact_upto = min(self._exact_upto, n)

    def _cut(self, n: int) -> None:
        """Keep the first n tokens, with last_logits re-derived by recomputing token n-1 in place
        (exact: same tile slot, same bits); all or nothing, as `_forward`."""
        if n == 0:
            self._truncate(0)
            self._last = None
            return
        self._last = self._forward(np.array([self._tokens[n - 1]], np.int64), n - 1)
        del self._tokens[n:]

    def _refresh_last(self) -> None:
        """Re-derive last_logits (None after a reposition) by recomputing the last token in place."""
        self._cut(len(self._tokens))

    # -- eviction --
    def evict(self, start: int, length: int, mode: str = "exact") -> EvictReport:
        """Remove the span [start, start+length); survivors after it move down by `length`.

        ```
        before:  | prefix 0..start-1 | span start..end-1 | survivors end..n-1 |
        after:   | prefix 0..start-1 | survivors start..n-length-1 |
                                       ^ each survivor i now sits at position i - length
        exact:       survivors re-derived from their token ids at the new positions
                     (== never-saw, bit-identical, at any depth; costs a prefill of the tail)
        reposition:  survivors keep Kraw and V; K re-rotated ONCE from Kraw at the new
                     position: K[i] = RoPE(Kraw[i], i) (never a composed rotation)
        tail span (end == n): nothing survives after it, both modes are a truncation
                     (write-time eviction: exact, nothing attended to the span yet)
        ```

        `reposition` is exact vs never-saw only for a 1-layer model: at layers >= 1 each survivor's
        K/V came from a hidden state that attended to the span at layer 0. The report says so.

        Args:
            start: first position to evict (>= 0).
            length: tokens to evict (>= 1, start + length <= len(self)).
            mode: "exact" or "reposition".

        Returns:
            EvictReport with an honest `exact` flag.

        Raises:
            InvalidArgument: bad mode, non-integer or out-of-range span (cache unchanged).
        """
        start, length = check_span(start, length, mode, len(self._tokens))
        n, end = len(self._tokens), start + length
        survivors, tail = self._tokens[end:], end == n
        # NOTE: each branch computes everything before it changes the session (a failure leaves it
        # as it was); the block table, tokens and last_logits change together at the end.
        if tail:
            self._cut(start)
        elif mode == "exact":
            last = self._forward(np.array(survivors, np.int64), start)
            self._tokens[start:] = survivors
            self._last = last
        if tail or mode == "exact":  # never-saw's unless the positions before the span carry an earlier span
            exact = self._exact_upto == len(self._tokens)
            # NOTE: logits are fresh only where a token is left to have them: a tail eviction from position 0 empties
            # the session (last_logits None), and it said logits_fresh=True
            return EvictReport(mode, start, length, tail, length, len(survivors), 0, exact, None, bool(self._tokens))
        delta = self._reposition(start, end)
        # NOTE: measured, not assumed. A 1-layer cache is exactly never-saw's when every survivor's
        # layer-0 row equals the one the prefill path derives from its token id at its new
        # position (the rows before the span are untouched). Deeper layers carry the span.
        if self.kernel.config.n_layers == 1 and delta == 0.0:  # layer 0 alone: each row a function of (id, position)
            self._exact_upto = len(self._tokens) if self._exact_upto >= start else self._exact_upto
        else:
            self._exact_upto = min(self._exact_upto, start)  # the survivors' layer >= 1 KV carries the span
        exact = self._exact_upto == len(self._tokens)
        return EvictReport(mode, start, length, False, length, 0, len(survivors), exact, delta, False)

    def _reposition(self, start: int, end: int) -> float:
        ops, n = self.kernel.ops, len(self._tokens)
        survivors = self._tokens[end:]
        m = len(survivors)
        data = self._kv.rows(end, n)  # [3, L, KV, m, hd], a fresh copy (cat)
        data[K_POST] = ops.rope(data[K_RAW], np.arange(start, start + m))  # [L, KV, m, hd]: once, from Kraw
        # NOTE: checked before it is stored (`data` is the bytes put_rows copies), so a failure in the
        # rotation or the checks leaves the session as it was; then the table swaps, allocation first.
        delta = max(rope_delta(ops, data, start), layer0_delta(ops, data, start, survivors))
        self._kv.install(self._kv.prepare(start, start + m))
        self._kv.put_rows(start, data)
        self._tokens[start:] = survivors
        self._last = None
        return delta

    def kv_numpy(self, lo: int, hi: int) -> np.ndarray:
        """A numpy copy of positions [lo, hi): [3, n_layers, n_kv_heads, hi-lo, head_dim] holding
        (K post-RoPE, Kraw pre-RoPE, V). For witnesses and tests."""
        a, b = as_int(lo), as_int(hi)
        if a is None or b is None or not 0 <= a < b <= len(self._tokens):
            raise InvalidArgument(f"kv_numpy needs 0 <= lo < hi <= {len(self._tokens)}, got {lo!r}, {hi!r}")
        return np.array(self.kernel.ops.to_numpy(self._kv.rows(a, b)), copy=True)

    def rope_invariant_delta(self, lo: int = 0, hi: int | None = None) -> float:
        """max|K[i] - RoPE(Kraw[i], i)| over positions [lo, hi), every layer (0.0 when it holds).

        The reference is computed by the prefill path's RoPE (`ops.rope_rows`: table slices from
        `lo`), not by `ops.rope` that `reposition` uses: a rotation at a wrong position or a wrong
        table row in the eviction path shows up here as > 0.
        """
        lo, hi = check_range(lo, hi, len(self._tokens))
        return rope_delta(self.kernel.ops, self._kv.rows(lo, hi), lo) if hi > lo else 0.0

    def layer0_delta(self, lo: int = 0, hi: int | None = None, memo: bool = True) -> float:
        """max|stored - recomputed| of layer-0 (K, Kraw, V) over positions [lo, hi), recomputed from
        the token ids by the prefill path (0.0 when layer 0 is exactly what a prefill would store).

        memo=True (what `EvictReport.invariant_delta` uses: a gather) takes each id's projection from
        the kernel's layer-0 memo, the table the prefill read too: it catches a row at the wrong
        position or rotated wrongly, not a wrong memo row. memo=False recomputes every projection
        afresh (one GEMV per token, `kvfleet witness` runs it): a wrong memo row shows up too.
        """
        lo, hi = check_range(lo, hi, len(self._tokens))
        rows = self._kv.rows(lo, hi)
        return layer0_delta(self.kernel.ops, rows, lo, self._tokens[lo:hi], memo) if hi > lo else 0.0

    # -- decode --
    def generate(self, n: int) -> list[int]:
        """Greedy-decode `n` tokens (appending them); returns the new ids.

        Raises:
            InvalidArgument: n not a non-negative integer, or an empty session (nothing appended).
            ResourceExhausted: len(self) + n exceeds the model's context (checked first: nothing
                appended; it used to append up to the limit and then raise).
        """
        n = check_count(n, len(self._tokens), self.kernel.config.max_context)
        out: list[int] = []
        for _ in range(n):
            if self._last is None:
                self._refresh_last()
            assert self._last is not None
            tok = int(np.argmax(self._last))
            self.append([tok])
            out.append(tok)
        return out

    # -- sharing --
    def fork(self) -> Session:
        """A copy-on-write branch: shares every block (ref_cnt += 1) until one side writes."""
        last = None if self._last is None else self._last.copy()
        return Session(self.kernel, self._kv.fork(), list(self._tokens), last, self._exact_upto)

    def memory(self) -> MemoryReport:
        """Bytes held alone vs shared (ref_cnt > 1, or adopted from / exported to a PrefixKV)."""
        bb = self.kernel.block_bytes
        shared = sum(1 for b in self._kv.blocks if b.shared)
        alone = len(self._kv.blocks) - shared
        return MemoryReport(alone * bb, shared * bb, len(self._kv.blocks), shared, len(self._tokens), bb)

    def export_prefix(self, num_tokens: int) -> PrefixKV:
        """The first `num_tokens` tokens (a multiple of block_size) as read-only block arrays.

        Zero-copy on the numpy and torch-CPU backends: the blocks are marked shared, so this
        session copies them before any later write.

        Raises:
            InvalidArgument: not a positive multiple of block_size within the session.
            FailedPrecondition: the prefix reaches past `num_exact_tokens` (a reposition's survivors): its
                blocks are not what a prefill of its tokens computes, and an adopter would take them as such.
        """
        BS, n = self.kernel.block_size, as_int(num_tokens)
        if n is None or n <= 0 or n % BS or n > len(self._tokens):
            raise InvalidArgument(
                f"export_prefix needs a positive multiple of block_size={BS} that is <= {len(self._tokens)}, "
                f"got {num_tokens!r}"
            )
        if n > self._exact_upto:
            raise FailedPrecondition(
                f"export_prefix({n}): positions from {self._exact_upto} on were re-rotated by a reposition eviction "
                "and still carry its span: they are not what a prefill of their tokens computes"
            )
        num_tokens = n
        arrays = []
        for blk in self._kv.blocks[: num_tokens // BS]:
            blk.external = True
            a = self.kernel.ops.to_numpy(blk.kv).view()
            a.flags.writeable = False
            arrays.append(a)
        return PrefixKV(tuple(self._tokens[:num_tokens]), BS, tuple(arrays), self.kernel.model_id)

    def digest(self) -> str:
        """sha256 over tokens, positions and every stored K/Kraw/V byte of positions [0, n)."""
        h, BS, n = hashlib.sha256(), self.kernel.block_size, len(self._tokens)
        h.update(np.asarray(self._tokens, np.int64).tobytes())
        h.update(np.arange(n, dtype=np.int64).tobytes())
        for b, blk in enumerate(self._kv.blocks):
            rows = min(BS, n - b * BS)
            if rows > 0:
                h.update(np.ascontiguousarray(self.kernel.ops.to_numpy(blk.kv)[:, :, :, :rows]).tobytes())
        return h.hexdigest()

    def close(self) -> None:
        """Release every block (ref counts go down); the session is empty afterwards."""
        self._truncate(0)
        self._last = None

    def __del__(self) -> None:
        try:
            self._kv.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
