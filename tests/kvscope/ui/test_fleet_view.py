"""The fleet window: its table says each instance's counts and trouble, its forest draws one square per instance
holding a block, its prompt box answers where a prompt would go (and rings the prompt's path), and the command line
saves a screenshot of it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.core.vllm_hashing import VllmBlockHasher
from engine.inspect.events import BlockStored
from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.runtime.kv_publisher import KVEventPublisher
from kvscope.sources.endpoints import connectable
from kvscope.sources.fleet import FleetSource
from kvscope.sources.fleet_spec import FleetSpec, InstanceSpec
from kvscope.ui.views.fleet_view import COLUMNS, FleetWindow, holder_squares

ROOT = Path(__file__).resolve().parents[3]
BS = 4
HASHER = VllmBlockHasher("sha256_cbor", "0")


def stored(tokens: list[int]) -> list[BlockStored]:
    out, parent = [], None
    for i, d in enumerate(HASHER.chain(tokens, BS)):
        out.append(BlockStored(i, d.hex(), "r", tuple(tokens[i * BS : (i + 1) * BS]), parent))
        parent = d.hex()
    return out


@pytest.fixture
def fleet():
    pubs = [
        KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"), BS)
        for _ in range(3)
    ]
    spec = FleetSpec(
        tuple(
            InstanceSpec(
                n, connectable(p.endpoint), connectable(p.replay_endpoint), hash_seed="0", bytes_per_block=1024
            )
            for n, p in zip("abc", pubs)
        ),
        "test fleet",
    )
    src = FleetSource(spec)
    shared = list(range(1, 3 * BS + 1))
    deadline = time.monotonic() + 20
    while not all(r.state == "up" for r in src.poll(0.05).instances):
        assert time.monotonic() < deadline
    pubs[0].publish(stored(shared + [50] * BS))
    pubs[1].publish(stored(shared + [60] * BS * 2))
    pubs[2].publish(stored([70] * BS))
    while [r.blocks for r in src.poll(0.05).instances] != [4, 5, 1]:
        assert time.monotonic() < deadline
    yield src, pubs, shared
    src.close()
    for p in pubs:
        p.close()


def cell(win: FleetWindow, row: int, col: str) -> str:
    return win.table.item(row, COLUMNS.index(col)).text()


def test_the_window_shows_each_instance_the_shared_blocks_and_where_a_prompt_goes(qtbot, fleet):
    src, pubs, shared = fleet
    win = FleetWindow(src, tokenize=None)
    qtbot.addWidget(win)
    win.on_record(src.poll(0.0), last=True)
    assert [cell(win, r, "blocks") for r in range(3)] == ["4", "5", "1"]
    assert [cell(win, r, "also elsewhere") for r in range(3)] == ["3", "3", "0"]
    assert cell(win, 0, "state") == "up" and cell(win, 0, "hashes").startswith("sha256_cbor, seed '0'")
    assert "3 held by two or more instances" in win.totals.text() and "3.0 KiB beyond one copy" in win.totals.text()
    # the forest: each block one square per holder, the shared three drawn twice
    squares = win.forest.squares.data
    assert len(squares) == 4 + 5 + 1 and win.forest.info.text().startswith("7 distinct blocks, 3 of them held by two")
    assert "held by a, b" in win.forest.node_text(0)
    # where would it go: token ids in the box (no tokenizer here)
    assert not win.kind.isEnabled() and win.kind.currentText() == "token ids"
    win.prompt.setText(", ".join(map(str, shared + [60] * BS * 2 + [9])))
    win.route_box()
    assert "b: 5 of its 5 full blocks cached (20 of 21 prompt tokens)" in win.answer.text()
    win.on_record(src.poll(0.0), last=True)
    assert [cell(win, r, "prompt's prefix") for r in range(3)] == ["3 of 5 blocks", "5 of 5 blocks", "0 of 5 blocks"]
    assert len(win.forest.route_edges.getData()[0]) == 2 * 4  # the path's 4 edges, in white
    win.prompt.setText("one, two")
    win.route_box()
    assert "whole numbers" in win.answer.text()


def test_an_instance_that_goes_away_turns_its_state_red(qtbot, fleet):
    src, pubs, _ = fleet
    win = FleetWindow(src)
    qtbot.addWidget(win)
    pubs[2].close()
    deadline = time.monotonic() + 20
    while True:
        rec = src.poll(0.05)
        win.on_record(rec)
        if rec.instances[2].state == "down":
            break
        assert time.monotonic() < deadline
    assert cell(win, 2, "state").startswith("down") and "instance c" in win.notices.text()
    assert win.table.item(2, 1).foreground().color().getRgb()[:3] == (229, 57, 53)
    assert win.table.item(0, 1).foreground().color().getRgb()[:3] != (229, 57, 53)


def test_holder_squares_sit_side_by_side_around_their_block():
    import numpy as np

    x, node, inst = holder_squares(np.array([0.0, 1.0]), [[0, 2], [1]], 0.2)
    assert x.tolist() == pytest.approx([-0.1, 0.1, 1.0]) and node.tolist() == [0, 0, 1] and inst == [0, 2, 1]


def test_the_fleet_window_screenshot_from_the_command_line(tmp_path, fleet):
    src, pubs, shared = fleet
    png = tmp_path / "fleet.png"
    args = []
    for p in pubs:
        args += ["--attach", connectable(p.endpoint), "--replay-endpoint", connectable(p.replay_endpoint)]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            *args,
            "--block-size",
            str(BS),
            "--hash-seed",
            "0",
            "--route-ids",
            ",".join(map(str, shared)),
            "--screenshot",
            str(png),
            "--steps",
            "10",
            "--window-size",
            "1280x720",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1", "QT_QPA_PLATFORM": "offscreen"},
    )
    assert r.returncode == 0, r.stderr
    assert png.stat().st_size > 10_000
