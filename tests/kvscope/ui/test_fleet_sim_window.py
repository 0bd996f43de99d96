"""The fleet window (issue 35): its source played in slices is the headless run; each frame's pools are the
instances' own; the window draws N pools, outlines the instance that got the latest request and says the
route; a screenshot of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import EngineConfig
from engine.inspect.snapshot import BlockState
from engine.workload import SimConfig, read_workload
from engine.workload.fleet import run_fleet
from engine.workload.fleet_config import FleetConfig
from kvscope.cli import main
from kvscope.sources.fleet_sim import SimFleetSource, SimFleetSpec, build_sim_fleet_source

ROOT = Path(__file__).resolve().parents[3]
CONVERSATION = ROOT / "resources" / "workloads" / "mooncake_conversation_200.jsonl"
COST_OF_THIS_MACHINE = {"wall_s", "peak_rss_mb"}


def source(instances: int = 3, router: str = "prefix-aware", limit: int = 40, blocks: int = 2000) -> SimFleetSource:
    return build_sim_fleet_source(
        SimFleetSpec(str(CONVERSATION), SimConfig(time_scale=0.2), FleetConfig(instances, router), limit),
        EngineConfig(block_size=16, num_gpu_blocks=blocks),
    )


@pytest.mark.parametrize("router", ["round-robin", "prefix-load"])
def test_the_fleet_source_played_in_slices_is_the_headless_run(router):
    src = source(router=router)
    slices = [7, 1, 300, 50]
    k = 0
    while src.has_work():
        frame = src.frame()
        for f, inst in zip(frame.instances, src.fleet.instances):  # each pool as the instance holds it
            pool = inst.engine.pool
            counts = np.bincount(f.states, minlength=len(BlockState))
            assert counts[BlockState.FREE] + counts[BlockState.CACHED] == pool.num_free_blocks
            assert counts[BlockState.CACHED] == inst.engine.ledger.num_cached_free and f.usage == pool.usage()
            assert f.running == len(inst.scheduler.running) and f.routed == inst.routed
        assert frame.routed == sum(f.routed for f in frame.instances) and not frame.done
        src.advance(events=slices[k % len(slices)])
        k += 1
    end = src.frame()
    assert end.done and end.routed + end.skipped == 40 and end.skipped > 0  # 2,000 blocks: two prompts too big
    live = src.result().summary()
    headless = run_fleet(
        read_workload(CONVERSATION, limit=40),
        EngineConfig(block_size=16, num_gpu_blocks=2000),
        SimConfig(time_scale=0.2),
        3,
        router,
    ).summary()
    assert {k: v for k, v in live.items() if k not in COST_OF_THIS_MACHINE} == {
        k: v for k, v in headless.items() if k not in COST_OF_THIS_MACHINE
    }


def test_advance_stops_at_a_virtual_time():
    src = source()
    before = src.fleet.now
    assert src.advance(until_s=5.0) > 0
    assert before < 5.0 <= src.fleet.now == src.frame().clock <= src.fleet.clock  # the present, not past a step
    assert src.advance(events=0) == 0


def test_the_window_draws_every_pool_and_the_latest_route(qtbot):
    from kvscope.sources.fleet_sim import TICK_S
    from kvscope.ui.poll_driver import PollDriver
    from kvscope.ui.views.fleet_sim_view import SimFleetWindow, best_columns

    src = source(instances=4, router="prefix-aware")
    win = SimFleetWindow(src)
    qtbot.addWidget(win)
    win.resize(1280, 720)
    win.show()
    driver = PollDriver(win, src, TICK_S)
    win.bind(driver)  # not started: the test ticks it
    driver.running = True
    win.speed.setCurrentText("max")
    while src.frame().routed < 12:
        driver.tick()
    frame = win.last_frame
    latest = frame.routes[-1]
    assert len(win.panels) == 4 and [p.highlighted for p in win.panels] == [i == latest.instance for i in range(4)]
    assert (
        win.route.text().startswith(f"latest route: L{latest.line} (")
        and f"→ instance {latest.instance} · cached prefix, blocks: " in win.route.text()
    )
    assert win.log.toPlainText().splitlines()[-1].startswith(f"L{latest.line} ")
    assert len(win.log.toPlainText().splitlines()) == frame.routed
    assert f"{frame.routed:,} of 40 requests routed" in win.status.text() and "skipped" in win.status.text()
    shares = [p.title.text() for p in win.panels]
    assert all("of requests" in t for t in shares)
    win.run_button.click()  # Pause
    assert win.run_button.text() == "Run" and not driver.timer.isActive() and not driver.running
    while src.has_work():
        driver.tick()
    assert "done" in win.status.text() and not win.run_button.isEnabled()
    assert best_columns(8, 1600, 800) == 4 and best_columns(4, 1280, 500) == 4 and best_columns(1, 500, 500) == 1
    assert best_columns(16, 1280, 500) in (6, 8)


def test_a_screenshot_of_a_fleet(tmp_path, capsys):
    png = tmp_path / "fleet.png"
    assert (
        main(
            [
                "--workload",
                str(CONVERSATION),
                "--limit",
                "30",
                "--instances",
                "4",
                "--router",
                "session",
                "--screenshot",
                str(png),
                "--steps",
                "400",
                "--window-size",
                "1280x720",
            ]
        )
        == 0
    )
    assert png.stat().st_size > 20_000
