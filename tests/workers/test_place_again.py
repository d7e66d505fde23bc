"""A create or fork whose host turns out full (another create took its last slot after both placements read the
same offers) is placed again, on a host with room, instead of failing with ResourceExhausted.

Two hosts on this one Ray node (host ids `nid` and `nid:gpu1`, as a node's second GPU's), two sessions each at
most (the `two_hosts` fixture, conftest.py). The race is forced: the first call to a host of the verb under test
runs another create to its end first."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import ray

from workers.fleet import KernelFleet


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what the test compares
        return e


@pytest.mark.parametrize("verb", ["create_session", "fork"])
def test_a_create_or_fork_that_lost_the_last_slot_is_placed_again(two_hosts: KernelFleet, tenant: str,
                                                                    verb: str) -> None:
    """Once placed, the try's host is filled by other calls (forks that name it) before the try reaches it.
    NOTE: before, the host refused it (ResourceExhausted) though the other host had room."""
    f = two_hosts
    f.create_session(tenant, "x", "You are agent x.")
    real, fired, box = f.nodes.call, threading.Event(), {"filled": []}

    def fill(node: str) -> None:
        while ray.get(f.nodes.hosts[node].stats.remote(), timeout=60)["sessions"] < 2:
            box["filled"].append(f.fork(tenant, "x", f"b{len(box['filled'])}", node=node)["node"])

    def hooked(node: str, method: str, *args: Any) -> Any:
        if method == verb and not fired.is_set():
            fired.set()                                     # other calls take the host's last slots first
            box["full"] = node
            th = threading.Thread(target=lambda: box.setdefault("err", _outcome(lambda: fill(node))))
            th.start()
            th.join()
        return real(node, method, *args)

    f.nodes.call = hooked  # type: ignore[method-assign]
    if verb == "fork":
        out = _outcome(lambda: f.fork(tenant, "x", "a"))
    else:
        out = _outcome(lambda: f.create_session(tenant, "a", "You are agent a."))
    f.nodes.call = real  # type: ignore[method-assign]
    print(f"{verb} a: {out!r:.120}; filled: {box}")
    assert box["err"] is None and box["filled"] and set(box["filled"]) == {box["full"]}
    assert isinstance(out, dict) and out["node"] != box["full"] and out["state"] == "active"
    # each host asked on its own: node_stats() leaves out a host that answers over a second after the first, as one
    # under load did once in a full run ([2] where [1, 2] was held)
    held = sorted(ray.get(h.stats.remote(), timeout=60)["sessions"] for h in f.nodes.hosts.values())
    assert f.tokens(tenant, "a")[:3] and held in ([1, 2], [2, 2])
