"""When the proxy probes a worker that sent no first byte: soon after the send (a sleeping vLLM accepts a request
and hangs), then ever less often, at most MAX_PROBE_WAIT_S apart (or MAX_PROBE_GAP first-byte timeouts, if
longer), so a long answer is not probed more often with a short first-byte timeout than with a long one."""

from __future__ import annotations

from itertools import islice

from controller.proxy.forward import MAX_PROBE_WAIT_S, probe_waits


def test_a_short_timeout_probes_early_then_backs_off_to_the_long_timeouts_cadence() -> None:
    short = list(islice(probe_waits(0.25), 8))
    print("0.25 s:", short)
    assert short == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert MAX_PROBE_WAIT_S == 8.0


def test_a_timeout_of_1s_or_more_keeps_its_schedule_of_1_2_4_then_8_timeouts() -> None:
    assert list(islice(probe_waits(1.0), 6)) == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert list(islice(probe_waits(3.0), 6)) == [3.0, 6.0, 12.0, 24.0, 24.0, 24.0]


def test_probes_within_a_minute_of_silence() -> None:
    def probes_within(timeout_s: float, horizon_s: float) -> int:
        t, n = 0.0, 0
        for wait in probe_waits(timeout_s):
            t += wait
            if t > horizon_s:
                return n
            n += 1
        raise AssertionError("unreachable")

    print({t: probes_within(t, 60.0) for t in (0.25, 1.0)})
    assert probes_within(0.25, 60.0) == 11  # 0.25, 0.75, 1.75, 3.75, 7.75, then every 8 s to 55.75
    assert probes_within(1.0, 60.0) == 9  # 1, 3, 7, 15, then every 8 s to 55
