"""The kernel pins its math library's thread count for each pass, also while two sessions' passes overlap (a kernel
host runs sessions of one kernel on several lane threads), and gives the caller's count back after the last."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from support.kernels import make_kernel


@contextmanager
def _caller_threads(backend: str, n: int) -> Iterator[Callable[[], int]]:
    """The caller's own thread count set to `n` for the test (restored after); yields a reader of the current one."""
    if backend == "torch":
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield torch.get_num_threads
        finally:
            torch.set_num_threads(before)
        return
    from threadpoolctl import ThreadpoolController

    ctl = ThreadpoolController()

    def blas() -> int:
        return int(ctl.select(user_api="blas").info()[0]["num_threads"])

    with ctl.limit(limits=n, user_api="blas"):
        yield blas


def test_overlapping_passes_stay_pinned_and_the_last_restores_the_callers_count(backend: str) -> None:
    """Each pass saved the count it found and restored it on exit: the first of two overlapping passes to finish
    unpinned the other (2 threads where the kernel's is 1), and the last left its pinned 1 for good."""
    ops = make_kernel(backend).ops                        # threads=1
    with _caller_threads(backend, 2) as current:
        if current() != 2:
            pytest.skip("the library cannot run 2 threads here")
        first, second = ops.limit(), ops.limit()
        first.__enter__()
        second.__enter__()                                # another session's pass, on another lane thread
        assert current() == 1
        first.__exit__(None, None, None)
        assert current() == 1                             # the second pass still runs pinned
        second.__exit__(None, None, None)
        assert current() == 2                             # the caller's count is back
