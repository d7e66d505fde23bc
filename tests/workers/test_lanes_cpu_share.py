"""A kernel host shares its CPU equally between tenants, whatever their number of threads (workers/lanes.py
`CpuShare`, fleet/core/kernel/pacing.py).

The jobs are the real numpy kernel's: tenant acme decodes on three of a host's four lane threads, tenant
bravo appends 1,000 tokens on the fourth. What is compared is CPU time (each thread's own clock), not wall
time: on a shared machine the wall clock says little, but the CPU each tenant got while the other ran is
what the scheduler decides.

NOTE: before `CpuShare` acme used ~3x bravo's CPU while bravo's append ran (the control below measures
this, every run), and bravo's append took ~5x its time alone (143 ms against 22 on a real 4-thread host;
44 ms after: bench/host_isolation.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from support.kernels import make_kernel, rand_ids

from fleet.core.kernel import Kernel, pacing
from workers.lanes import TenantLanes

pytestmark = pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"),
                                reason="no per-thread CPU clocks here: the host shares no CPU (CpuShare.enabled)")

# NOTE: a wait long beside a thread's wake-up delay on a loaded machine: waits of 30-50 ms each woken late read as
# bound by the lock (1.3x) in a fresh-clone run at load average 26; the speedup of waits of s each woken d late is
# about 2(s + d) / (s + 2d), over 1.4 at 150 ms for a delay up to 50 ms
WAIT_S = 0.15


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    return make_kernel("numpy")


class Hog:
    """A tenant's `n` jobs that decode until stopped; `cpu()` is their CPU so far."""

    def __init__(self, lanes: TenantLanes, kernel: Kernel, n: int, tenant: str = "acme") -> None:
        self.kernel, self.stop = kernel, threading.Event()
        self.clocks: list[tuple[int, float] | None] = [None] * n   # each job thread's CPU clock and its start
        self.jobs = [asyncio.ensure_future(lanes.run(tenant, lambda k=k: self._job(k))) for k in range(n)]

    def _job(self, k: int) -> None:
        s = self.kernel.session()
        s.append(rand_ids(k, 50))
        clock = time.pthread_getcpuclockid(threading.get_ident())
        self.clocks[k] = (clock, time.clock_gettime(clock))
        while not self.stop.is_set():
            s.generate(4)
            if len(s) > 1000:
                s = self.kernel.session()
                s.append(rand_ids(k, 50))

    def cpu(self) -> float:
        """The jobs' CPU so far, read live from their threads' clocks."""
        return sum(time.clock_gettime(c) - t0 for c, t0 in filter(None, self.clocks))

    async def wait_started(self) -> None:
        while not all(self.clocks):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.jobs)


def append_1000(kernel: Kernel, times: int = 1) -> Callable[[], None]:
    """A job: `times` appends of 1,000 tokens, each to a new session."""
    def job() -> None:
        for _ in range(times):
            kernel.session().append(rand_ids(7, 1000))
    return job


async def beside_hog(kernel: Kernel, paced: bool, work: Callable[[], None]) -> tuple[float, float, TenantLanes]:
    """(acme's CPU while bravo's job ran, bravo's CPU in it, the lanes): acme on 3 of 4 threads."""
    lanes = TenantLanes(4)
    lanes.share.enabled = paced
    hog = Hog(lanes, kernel, 3)
    await hog.wait_started()
    marks: dict[str, float] = {}

    def victim() -> None:
        marks["a0"], t0 = hog.cpu(), time.thread_time()
        work()
        marks["a1"], marks["b"] = hog.cpu(), time.thread_time() - t0

    await lanes.run("bravo", victim)
    await hog.finish()
    lanes.shutdown()
    return marks["a1"] - marks["a0"], marks["b"], lanes


def test_a_tenant_on_three_threads_gets_the_cpu_share_of_one(kernel: Kernel) -> None:
    async def main() -> None:
        # the control, measured up to three times: the machine's other load can take acme's threads off the cores
        # (one loaded CI run read 1.96x; alone it reads 2.5-3.6x)
        for _ in range(3):
            a_off, b_off, _ = await beside_hog(kernel, False, append_1000(kernel, 3))
            if a_off / b_off > 2.0:
                break
        a_on, b_on, lanes = await beside_hog(kernel, True, append_1000(kernel, 3))
        print(f"acme's CPU while bravo's append ran: unpaced {a_off:.3f} s ({a_off / b_off:.2f}x bravo's), "
              f"paced {a_on:.3f} s ({a_on / b_on:.2f}x bravo's); {lanes.stats()}")
        assert a_off / b_off > 2.0          # the control: three threads take ~3x the CPU of one
        assert 0.5 < a_on / b_on < 1.6      # now about level (acme leads by at most lead_s at a time); NOTE: the
        # lower bound: without the arrival floor bravo started 0 against acme's time, and acme got 0.26x
        assert lanes.stats()["parks"] > 0

    asyncio.run(main())


def test_nobody_waits_for_a_tenant_whose_job_uses_no_cpu(kernel: Kernel) -> None:
    """bravo's job waits 0.4 s on something else (a fetch, the store): acme keeps the CPU, after at most idle_s."""
    async def main() -> None:
        a, b, lanes = await beside_hog(kernel, True, lambda: time.sleep(0.4))
        print(f"acme's CPU while bravo's job slept 0.4 s: {a:.3f} s; parked {lanes.share.parked_s:.3f} s in all")
        assert b < 0.05
        # NOTE: acme's three threads may each wait up to idle_s (0.01 s) before bravo counts as idle: 0.03 s
        # at most, against 1.2 s if they waited for bravo's clock to move
        assert lanes.share.parked_s < 0.3, lanes.share.parked_s

    asyncio.run(main())


@pytest.mark.parametrize("debt_s", [0.0, 0.3])
def test_a_tenant_alone_never_waits_and_a_returning_one_owes_nothing(kernel: Kernel, debt_s: float) -> None:
    """acme runs alone (about 0.3 s of CPU) and leaves; bravo arrives; acme comes back beside it and is not held
    back for its time alone. debt_s > 0 is the control: acme returns that far ahead of the fleet, as it would if it
    kept the CPU it used alone against it, and then waits while bravo catches up. NOTE: found by review: the virtual
    time did not move while a tenant ran alone, so acme came back owing all of it (a 50 ms job took 1.01 s)."""
    async def main() -> None:
        lanes = TenantLanes(4)
        # NOTE: bravo's clock must not look idle (still for idle_s, 10 ms) while the OS has it off a core: on a
        # loaded machine acme then stopped waiting for it and the control failed once. Idleness is tested apart.
        lanes.share.idle_s = 0.2
        for _ in range(10):
            await asyncio.gather(*(lanes.run("acme", append_1000(kernel)) for _ in range(3)))
        assert lanes.stats()["parks"] == 0          # alone: no tenant to wait for
        hog = Hog(lanes, kernel, 1, tenant="bravo")  # acme left; bravo runs alone, acme comes back
        await hog.wait_started()
        if debt_s:
            lanes.share._used["acme"] = lanes.share.vt + debt_s
        before, parked0 = hog.cpu(), lanes.stats()["parked_ms"]
        await lanes.run("acme", append_1000(kernel))
        during, parked = hog.cpu() - before, lanes.stats()["parked_ms"] - parked0
        await hog.finish()
        lanes.shutdown()
        print(f"debt {debt_s} s: bravo's CPU while acme's returning append ran: {during:.3f} s; parked {parked} ms")
        if debt_s:
            assert during > debt_s / 2 and parked > 1000 * debt_s / 2
        else:   # NOTE: held back by nothing (before the fix: about 1 s). Bravo's CPU meanwhile (~0.03 s here) is no
            # measure of that: a loaded fresh-clone run had acme's thread off its core while bravo ran 0.32 s
            assert parked < 250

    asyncio.run(main())


def test_a_host_shares_its_cpu_only_where_the_interpreter_lock_is_what_tenants_share(kernel: Kernel) -> None:
    """The test kernel holds the lock: two threads are no faster than one, so a host shares its CPU per tenant.
    The control: work that releases the lock (a wait here; BLAS on a model large enough, which ran 1.8x faster on
    two threads for a 512-wide numpy model) runs twice as fast on two threads, and is not shared: holding a tenant
    to another's pace there would idle a core. NOTE: the first version shared on every host."""
    from workers.lanes import interpreter_bound

    ids = rand_ids(3, 64)
    tiny = interpreter_bound(lambda: kernel.session().append(ids))
    waits = interpreter_bound(lambda: time.sleep(WAIT_S))
    print(f"two threads against one: the test kernel {tiny[1]}x, a {WAIT_S * 1e3:.0f} ms wait {waits[1]}x")
    assert tiny[0] is True
    # the control is the verdict (a speedup of at least interpreter_bound's 1.4x), not a margin above it: a
    # fresh-clone run at load average 12 measured 50 ms waits at 1.58x, the kernel at 0.4x
    assert waits[0] is False


def test_a_tenant_back_from_waiting_gets_no_credit_for_the_wait(kernel: Kernel) -> None:
    """bravo's job waits 0.5 s (a fetch) while acme decodes on three threads, then computes: it comes back at the
    fleet's time, not with 0.5 s of acme's CPU banked. NOTE: found by review: an idle tenant held the virtual time
    back, and acme got no CPU at all while bravo computed after its wait."""
    async def main() -> None:
        lanes = TenantLanes(4)
        hog = Hog(lanes, kernel, 3)
        await hog.wait_started()
        marks: dict[str, float] = {}

        def bravo() -> None:
            time.sleep(0.5)
            marks["a0"], t0 = hog.cpu(), time.thread_time()
            kernel.session().append(rand_ids(7, 1000))
            kernel.session().append(rand_ids(8, 1000))
            marks["a"], marks["b"] = hog.cpu() - marks["a0"], time.thread_time() - t0

        await lanes.run("bravo", bravo)
        await hog.finish()
        lanes.shutdown()
        print(f"after its wait, bravo computed {marks['b']:.3f} s while acme got {marks['a']:.3f} s")
        assert marks["a"] > 0.3 * marks["b"]   # level: about bravo's; with the credit banked, none

    asyncio.run(main())


def test_the_kernel_yields_once_per_layer_and_waiting_there_changes_no_bit(kernel: Kernel) -> None:
    k = kernel
    ids = rand_ids(3, 300)
    ref = k.session().append(ids)
    calls = [0]

    def slow() -> None:
        calls[0] += 1
        time.sleep(0.0005)

    s = k.session()
    with pacing.paced(slow):
        out = s.append(ids[:100])
        out = s.append(ids[100:])
    assert calls[0] == 2 * k.config.n_layers        # one tile group per call here, one yield per layer
    assert (out == ref).all()
    calls[0] = 0
    k.session().append(ids)                         # no hook installed: a yield point does nothing
    assert calls[0] == 0


def test_one_disturbed_measurement_does_not_decide_whether_a_kernel_is_interpreter_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock-bound job whose first timed run the OS takes off its core (0.1 s more on that run) looked 3x faster on
    two threads from that one measurement, and the host would have shared no CPU for its life. The median of five
    measurements says bound. The job runs on a clock of its own, which only the job moves: 0.02 s a run, one run at
    a time (a lock, as the interpreter's), so no load on the machine moves the figures. NOTE: it spun on the real
    clock, and a fresh-clone run of the whole suite, the machine loaded, measured 1.44 and failed. The control, a job
    that waits (the lock released, real sleeps that overlap), is still not bound."""
    from workers import lanes

    clock, held, calls = [0.0], threading.Lock(), [0]

    def spin() -> None:
        with held:
            calls[0] += 1
            clock[0] += 0.02 + (0.1 if calls[0] == 2 else 0.0)   # the first run in turn that is timed is disturbed

    class JobClock:
        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

        def perf_counter(self) -> float:
            return clock[0]

    with monkeypatch.context() as m:
        m.setattr(lanes, "time", JobClock())
        bound, speedup = lanes.interpreter_bound(spin)
        one = lanes.interpreter_bound(spin, rounds=1)   # (calls 12 on: undisturbed) one measurement alone
        calls[0] = 0
        disturbed = lanes.interpreter_bound(spin, rounds=1)   # one measurement, the disturbed one: not bound
    print(f"lock-bound job, one timed run disturbed: median speedup {speedup}; one measurement: {disturbed[1]} "
          f"disturbed, {one[1]} not")
    assert bound and speedup == 1.0
    assert one == (True, 1.0) and disturbed == (False, 3.5)
    assert not lanes.interpreter_bound(lambda: time.sleep(WAIT_S))[0]   # control: waits, not CPU
