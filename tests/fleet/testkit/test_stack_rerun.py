"""A stack started again on the same state dir (a second `kvfleet up --sim-workers N`, its default ./var) replaces
the stand-ins the first one registered. NOTE: the second start stopped at "worker 'w0' is registered with another
spec; unregister it first", and a smaller second stack waited for the first one's dead extra stand-in to serve
(review finding). A worker registered by hand under another name is left alone (the control)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fleet.app.testkit.stack import StackConfig, start_stack


async def test_a_stack_started_again_on_its_state_dir_replaces_its_stand_ins(tmp_path: Path) -> None:
    cfg = StackConfig(store_url=f"sqlite:///{tmp_path}/kvfleet.db", state_dir=str(tmp_path), workers=2,
                      sessions=False, metrics=True)
    first = await start_stack(cfg)
    try:
        extra = first.sims["w1"]
        await first.admin.register_worker("mine", url=extra.url, kv_events=extra.kv_events, replay=extra.replay,
                                          model=cfg.model)
    finally:
        await first.stop()
    second = await start_stack(dataclasses.replace(cfg, workers=1))
    try:
        rows = {w.name: w for w in await second.admin.workers()}
        print({n: (w.url, w.serving) for n, w in rows.items()})
        assert set(rows) == {"w0", "mine"}                     # w1 (the first stack's) is gone; "mine" is kept
        assert rows["w0"].url == second.sims["w0"].url and rows["w0"].serving
    finally:
        await second.stop()
