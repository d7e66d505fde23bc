"""The proxy's own word on workers it found asleep or gone behind the controller's back ("suspect" marks).

A mark skips the worker for `suspect_s` unless the controller catches up first: it lists the worker serving again,
or routes to it, under a newer epoch than the mark keeps for that DP rank (the controller saw the sleep and the
wake, or a restart, itself). An awake worker that fails `after_failures` attempts in a row that no probe explained
is marked too. docs/proxy.md ("Failover and the sleeping worker hazard") says why each rule is as it is.
"""

from __future__ import annotations

import time

from fleet.sdk.types import WorkerInfo


class SuspectMarks:
    def __init__(self, suspect_s: float, after_failures: int) -> None:
        self.suspect_s, self.after_failures = suspect_s, after_failures
        # name -> (until, per DP rank: the newest epoch under which the controller is known to have had it serving)
        self._marks: dict[str, tuple[float, dict[int, int]]] = {}
        self._failures: dict[str, int] = {}  # name -> failed attempts in a row that no probe explained

    def holds(self, name: str, listed: WorkerInfo | None, routed_epoch: int | None = None,
              rank: int | None = None) -> bool:
        """Found asleep (or gone) by this proxy less than suspect_s ago, and the controller has not caught up
        since: a worker the controller lists (`listed`: the proxy's listing of it) as serving again under a newer
        epoch than it had when marked has been seen to sleep and wake (or restart) by the controller itself, so its
        answer routes again (issue #27: a woken worker skipped for the rest of suspect_s sent the controller's
        choices to runners-up the controller had ranked below it). `routed_epoch`: the epoch a route to the
        worker's DP rank `rank` was decided under, just now; newer than the mark's for that rank, it is the same
        proof, fresher than the listing (no `rank`: compared with the newest of the mark's ranks).
        NOTE: epochs are per DP rank, and the mark kept one number, the newest of every rank's: a route to a
        woken DP worker's rank whose epoch trailed another's (each rank steps on its own clears) was not newer
        than it, and was skipped until the next listing refresh, the only worker of a model answering 503 that
        long (found by review; tests/controller/proxy/test_proxy_dp_suspect.py)."""
        mark = self._marks.get(name)
        if mark is None:
            return False
        until, epochs = mark
        newest = max(epochs.values(), default=-1)  # what a rank the mark knows nothing of is compared with
        newer_listed = listed is not None and any(
            r.serving and r.epoch > epochs.get(r.dp_rank, newest) for r in listed.ranks)
        known = newest if rank is None else epochs.get(rank, newest)
        if until <= time.monotonic() or newer_listed or (routed_epoch is not None and routed_epoch > known):
            del self._marks[name]
            return False
        return True

    def mark(self, name: str, listed: WorkerInfo | None, routed_epoch: int | None = None,
             rank: int | None = None) -> None:
        """Mark the worker found asleep or gone. The mark keeps, per DP rank, the newest epoch under which the
        controller is known to have had it serving: the one the failed attempt was routed under (its rank's;
        no `rank`: every rank's), or the listing's where the listing says the rank serves (fresher when the route
        is older), so only a route decided after the controller saw a newer life of the worker clears it. A rank
        the listing shows not serving keeps one less than its listed epoch: the controller saw it stop (a sleep
        seen steps the epoch, which the wake keeps), and a route under that epoch is decided after it saw it
        serve again. NOTE: a listing that already said "not serving" (the controller had seen the sleep, under a
        new epoch, before this proxy judged an attempt routed earlier) gave the mark that new epoch, and the wake
        keeps it: the controller routed to the woken worker under that same epoch, and the proxy skipped it for
        the rest of suspect_s (issue #27: 45 skips and 1.7x the prefill in one routing bench run of
        agents16x4/very-tight)."""
        epochs = ({r.dp_rank: r.epoch if r.serving else r.epoch - 1 for r in listed.ranks}
                  if listed is not None else {})
        if routed_epoch is not None:  # no rank: every rank's (a worker not listed: any rank's, as key -1)
            for r in [rank] if rank is not None else list(epochs) or [-1]:
                epochs[r] = max(epochs.get(r, -1), routed_epoch)
        self._marks[name] = (time.monotonic() + self.suspect_s, epochs)
        self._failures.pop(name, None)

    def failed(self, name: str, listed: WorkerInfo | None, routed_epoch: int | None = None,
               rank: int | None = None) -> bool:
        """An attempt on the worker failed (a 503, a lost connection) though a probe found it neither asleep nor
        gone. The after_failures-th such failure in a row, with no answer between, marks it suspect (True): a
        worker that fails every request while it says it is awake is skipped too."""
        n = self._failures.get(name, 0) + 1
        if n < self.after_failures:
            self._failures[name] = n
            return False
        self.mark(name, listed, routed_epoch, rank)
        return True

    def answered(self, name: str) -> None:
        """An attempt on the worker got its first byte: its failures in a row start again from none."""
        if self._failures:
            self._failures.pop(name, None)

    def forget(self, name: str) -> None:
        """The worker is gone from the listing (unregistered): nothing is kept for its name."""
        self._marks.pop(name, None)
        self._failures.pop(name, None)
