"""Every window kind opens through the one host (``kvscope.ui.host``) and gets the same three things: ``--font-scale``
applied to its text, ``--screenshot`` (at ``--window-size``) taken, and a clean teardown (the window deleted, its
engine process gone, nothing left in /dev/shm). Run through ``kvscope``'s own command line, in this process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication

from kvscope.cli import main
from kvscope.ui import host
from kvscope.ui.style import set_text_scale

ROOT = Path(__file__).resolve().parents[3]
SIZE = (1280, 720)  # the projector size; every kind's minimum fits in it
SCALE = 1.5


@pytest.fixture
def hosted(monkeypatch, qapp):
    """What the host saw of each window as it ended: its class, the application's font then, and whether the
    window still existed after the host deleted it."""
    seen: list[dict] = []
    real = host.dispose

    def watch(win) -> None:
        seen.append({"kind": type(win).__name__, "font_pt": QApplication.font().pointSizeF(), "win": win})
        real(win)

    monkeypatch.setattr(host, "dispose", watch)
    base = qapp.property("kvscope_base_font_pt") or qapp.font().pointSizeF()
    yield seen, float(base)
    set_text_scale(qapp, 1.0)  # the next test starts at the platform's size


def shm_names() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


def check(seen, base: float, png: Path, kind: str, code: int) -> None:
    assert code == 0, kind
    assert [s["kind"] for s in seen] == [kind]
    assert seen[0]["font_pt"] == pytest.approx(base * SCALE), kind  # --font-scale reached the window's text
    img = QImage(str(png))
    assert not img.isNull() and (img.width(), img.height()) == SIZE, kind
    from shiboken6 import isValid

    assert not isValid(seen[0]["win"]), f"{kind}: the window was not deleted"
    assert not [w for w in QApplication.topLevelWidgets() if w.isVisible()], kind


def args(png: Path, *rest: str) -> list[str]:
    return [*rest, "--screenshot", str(png), "--window-size", f"{SIZE[0]}x{SIZE[1]}", "--font-scale", str(SCALE)]


def test_the_main_window_on_an_engine_process(hosted, tmp_path, tiny_dir):
    seen, base = hosted
    before = shm_names()
    png = tmp_path / "main.png"
    code = main(
        args(png, "--model", tiny_dir, "--num-gpu-blocks", "32", "--block-size", "4", "--inject-ids", "1,2,3,4,5")
        + ["--steps", "3", "--max-tokens", "4"]
    )
    check(seen, base, png, "MainWindow", code)
    deadline = time.monotonic() + 10
    while shm_names() - before and time.monotonic() < deadline:  # the engine process unlinks as it exits
        time.sleep(0.05)
    assert not shm_names() - before, "shared memory left behind"


def test_the_main_window_on_a_replay(hosted, tmp_path, tiny_dir):
    seen, base = hosted
    trace = tmp_path / "run.trace"
    assert (
        main(
            ["--headless", "--model", tiny_dir, "--num-gpu-blocks", "32", "--block-size", "4"]
            + ["--inject-ids", "1,2,3,4,5", "--max-tokens", "4", "--trace", str(trace)]
        )
        == 0
    )
    png = tmp_path / "replay.png"
    check(seen, base, png, "MainWindow", main(args(png, "--replay", str(trace), "--steps", "3")))


def test_the_main_window_on_a_probed_vllm_recording(hosted, tmp_path):
    seen, base = hosted
    png = tmp_path / "probe.png"
    check(seen, base, png, "MainWindow", main(args(png, "--scenario", "lab-vllm-leak", "--steps", "12")))


def test_the_attach_window(hosted, tmp_path):
    from engine.inspect.kv_wire import WireStored, encode_batch
    from kvscope.sources.attach_trace import AttachTraceWriter
    from kvscope.sources.attached import AttachConfig, _Applier

    seen, base = hosted
    trace = tmp_path / "attach.jsonl"
    a = _Applier(AttachConfig("tcp://127.0.0.1:1"), AttachTraceWriter(trace, {"endpoints": ["tcp://127.0.0.1:1"]}))
    for i in range(4):
        a.apply(0, i, encode_batch([WireStored((10 + i,), 10 + i - 1 if i else None, (i, i), 2)], 0.0), "live", 0)
        a.finish_tick(float(i))
    a.trace.close()
    png = tmp_path / "attach.png"
    check(seen, base, png, "AttachWindow", main(args(png, "--replay", str(trace))))


def test_the_fleet_window(hosted, tmp_path):
    from kvscope.runtime.kv_events_options import KVEventsConfig
    from kvscope.runtime.kv_publisher import KVEventPublisher
    from kvscope.sources.endpoints import connectable

    seen, base = hosted
    pubs = [
        KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"), 4)
        for _ in range(2)
    ]
    try:
        png = tmp_path / "fleet.png"
        attach = [w for p in pubs for w in ("--attach", connectable(p.endpoint))]
        check(seen, base, png, "FleetWindow", main(args(png, *attach, "--steps", "5")))
    finally:
        for p in pubs:
            p.close()


def test_the_simulated_fleet_window(hosted, tmp_path):
    seen, base = hosted
    png = tmp_path / "sim.png"
    trace = str(ROOT / "resources" / "workloads" / "mooncake_synthetic_200.jsonl")
    code = main(args(png, "--workload", trace, "--instances", "2", "--limit", "30", "--steps", "200"))
    check(seen, base, png, "SimFleetWindow", code)


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--attach", "tcp://127.0.0.1:9", "--present"], "not with --attach"),
        (["--attach", "tcp://127.0.0.1:9", "--attach", "tcp://127.0.0.1:10", "--present"], "not with a fleet"),
        (
            ["--workload", "resources/workloads/mooncake_synthetic_200.jsonl", "--instances", "2", "--present"],
            "not with --instances",
        ),
    ],
)
def test_presentation_is_refused_in_one_line_where_there_is_no_lesson(argv, says, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    monkeypatch.setenv("DISPLAY", os.environ.get("DISPLAY", ":0"))  # only while this test runs
    assert main([*argv, "--screenshot", "x.png"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "--present shows a lesson" in err[0], err
