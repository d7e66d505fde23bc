"""JudgeLane (controller/judge_lane.py) alone: one tenant's queues and CPU bucket, with no pool or loop of its own.
The bucket's clock is passed in, so the values are exact."""

from __future__ import annotations

import asyncio

from controller.judge_lane import JudgeJob, JudgeLane


def test_bucket_refills_at_the_rate_up_to_the_burst_and_is_charged_per_job() -> None:
    lane = JudgeLane(balance=1.0, stamp=10.0)
    lane.started(0)
    lane.ended(0, 3.0)  # an overrun: the bucket goes below 0
    assert (lane.balance, lane.cpu_s, lane.jobs, lane.running) == (-2.0, 3.0, 1, [0, 0])
    lane.refill(14.0, 0.5, 5.0)
    assert (lane.balance, lane.stamp) == (0.0, 14.0)
    lane.refill(34.0, 0.5, 5.0)
    assert lane.balance == 5.0  # capped at the burst
    lane.refill(40.0, 0.0, 5.0)  # control: rate 0 (no budget) moves the stamp only
    assert (lane.balance, lane.stamp) == (5.0, 40.0)


async def test_cancelled_jobs_are_skipped_and_dropped() -> None:
    loop = asyncio.get_running_loop()
    lane = JudgeLane(balance=5.0, stamp=0.0)
    gone, live = loop.create_future(), loop.create_future()
    lane.now.extend([JudgeJob(lambda: "gone", gone), JudgeJob(lambda: "live", live)])
    lane.later.append(JudgeJob(lambda: "bg", None))
    gone.cancel()
    lane.drop_gone()
    assert [job.fn() for job in lane.now] == ["live"]
    assert lane.stats()["queued"] == 2
    live.cancel()
    assert lane.next(0) is None and not lane.now  # skipped on the way, and dropped
    assert lane.next(1) is not None  # control: a background job has no waiter to go away
    lane.cancel_queued()
    assert lane.stats() == {"cpu_s": 0.0, "jobs": 0, "queued": 0, "inflight": 0, "dropped": 0, "throttled": 0,
                            "balance": 5.0, "later_bytes": 0}
