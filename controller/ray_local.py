"""A controller that starts a local Ray owns its whole process tree (issue #31 item 4).

`ray.init()` without an address starts Ray's daemons (GCS, raylet, dashboard, log monitor) as
children of the controller, and the raylet starts its agents (DashboardAgent, RuntimeEnvAgent) and
workers. Ray stops what it started itself at a graceful exit, but its agents notice their raylet's
death only by polling, about 60 s later; after a SIGKILL of the controller nothing stops them.

So `start()` starts the local Ray inside a process group of its own, G:

- a controller that is not a group leader (started from a shell) becomes one for the few seconds
  of `ray.init`, so everything Ray starts then is in G (G = the controller's pid), and goes back
  to its own group afterwards (a session leader, e.g. PID 1 of a container, already leads its group,
  which then is G);
- a watchdog (a small `python -c` process, in G too) waits for the controller: when it goes, by a
  graceful stop (`stop()` signals it) or a SIGKILL (its parent changes), it SIGTERMs every process
  of G and the processes they started (Ray's workers lead groups of their own), SIGKILLs what is
  left after `GRACE_S`, and exits. Nothing of the tree survives the controller by more than about
  GRACE_S + one watchdog tick.

`kvfleet controller`, `kvfleet up` and `kvfleet demo` turn this on (`own()`); with --ray-address the cluster
is not ours.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

GRACE_S = 1.5  # SIGTERM, then SIGKILL after this
TICK_S = 0.2  # how often the watchdog looks at its parent

_state: dict[str, Any] = {"own": False, "watchdog": None}

# The watchdog: argv = controller pid, group; stdlib only, no import of kvfleet or Ray.
WATCHDOG = r"""
import os, signal, sys, time
ctl, group, grace, tick = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
me, stop = os.getpid(), []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's Ctrl-C is the controller's to handle
while not stop and os.getppid() == ctl:
    time.sleep(tick)

def table():
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    s = f.read()
                fields = s[s.rindex(")") + 2:].split()
                out[int(d)] = (int(fields[1]), int(fields[2]), fields[0])  # ppid, pgid, state
            except (OSError, ValueError):
                pass
    return out

def tree():
    t = table()
    pids = {p for p, (_, g, st) in t.items() if g == group and st != "Z"}
    grew = True
    while grew:
        more = {p for p, (pp, _, st) in t.items() if pp in pids and st != "Z"} - pids
        pids |= more
        grew = bool(more)
    return pids - {me, ctl}

for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.2), (signal.SIGKILL, 0.0)):
    for p in tree():
        try:
            os.kill(p, sig)
        except OSError:
            pass
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and tree():
        time.sleep(0.05)
"""


def own() -> None:
    """From now on, a local Ray started through `start()` is owned: torn down with the controller."""
    _state["own"] = True


def owned() -> bool:
    return bool(_state["own"])


def start(init: Any) -> None:
    """Run `init()` (which starts the local Ray) inside a process group of its own, watched (module doc).

    Not owning (`own()` not called), it just runs `init()`."""
    if not _state["own"] or _state["watchdog"] is not None:
        init()
        return
    me, before = os.getpid(), os.getpgid(0)
    moved = False
    if before != me:
        try:
            os.setpgid(0, 0)
            moved = True
        except OSError:  # a session leader leads its group already; anything else: as before
            pass
    group = os.getpgid(0)
    try:
        _state["watchdog"] = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(me), str(group), str(GRACE_S), str(TICK_S)],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        init()
    finally:
        if moved:
            with contextlib.suppress(OSError):
                os.setpgid(0, before)


def stop(timeout_s: float = 10.0) -> None:
    """Tear the owned Ray down now: disconnect this driver (Ray stops the daemons it started), then
    the watchdog ends whatever is left (its agents) and exits. A no-op if none was started."""
    w: subprocess.Popen[bytes] | None = _state["watchdog"]
    if w is None:
        return
    _state["watchdog"] = None
    import ray

    with contextlib.suppress(Exception):
        ray.shutdown()
    with contextlib.suppress(OSError):
        w.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        w.wait(timeout_s)
