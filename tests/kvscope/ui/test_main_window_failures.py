"""The window and --screenshot under failures: a message, never a crash or a hang."""

from __future__ import annotations

import argparse
import json

import pytest

from engine import EngineConfig, LLMEngine
from kvscope.cli.headless import build_session
from kvscope.ui.app import StartupDriver
from kvscope.ui.main_window import MainWindow
from tests.kvscope.ui.test_main_window import loaded, make_window, settings  # noqa: F401 - fixtures


def failing_engine(tiny_hf, where: str):
    def factory():
        eng = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", num_gpu_blocks=32, block_size=4)
        boom = lambda *_: (_ for _ in ()).throw(RuntimeError("injected failure"))  # noqa: E731
        if where == "model":  # the engine fails the step's requests and says so
            eng.runner.execute = boom
        else:  # the session's step raises (a scenario request refused mid-run, a bug): the worker stops stepping
            eng.step = boom
        return eng

    return factory


@pytest.mark.parametrize("where", ["model", "session"])
def test_a_screenshot_after_a_failed_step_saves_and_exits_non_zero(
    qtbot,
    make_window,  # noqa: F811
    tiny_hf,
    tmp_path,
    where,
):
    win = make_window(failing_engine(tiny_hf, where), start=False)
    path = tmp_path / "shot.png"
    driver = StartupDriver(win, str(path), 5, [[1, 2, 3, 4, 5]], 8)
    win.start()
    qtbot.waitUntil(lambda: path.exists() and not win.isVisible(), timeout=30_000)
    assert driver.exit_code == 1
    assert any("injected failure" in e for e in win.errors)


def test_a_screenshot_that_cannot_be_saved_says_so(qtbot, make_window, tmp_path, capsys):  # noqa: F811
    (tmp_path / "file.txt").write_text("x")
    win = make_window(start=False)
    driver = StartupDriver(win, str(tmp_path / "file.txt" / "shot.png"), 2, [[1, 2, 3]], 4)
    win.start()
    qtbot.waitUntil(lambda: not win.isVisible(), timeout=30_000)
    assert driver.exit_code == 1
    assert "could not save" in capsys.readouterr().err


def test_a_scenario_the_engine_refuses_is_a_message_in_the_window(qtbot, tiny_dir, tmp_path, settings):  # noqa: F811
    sc = tmp_path / "big.json"
    sc.write_text(
        json.dumps(
            {
                "config": {"block_size": 4, "num_gpu_blocks": 8},
                "requests": [{"prompt": list(range(1, 100)), "max_tokens": 4}],
            }
        )
    )
    args = argparse.Namespace(replay=None, scenario=str(sc), trace=None, audit=False)
    win = MainWindow(lambda _s: build_session(EngineConfig(model=tiny_dir), args), settings)
    qtbot.addWidget(win)
    win.show()
    win.start()
    qtbot.waitUntil(lambda: win.banner.isVisible(), timeout=20_000)
    assert "request 0 is refused: this request can never fit" in win.banner.text()
    assert win.isVisible() and not win.act_step.isEnabled()
    win.shutdown()


def test_a_prompt_with_a_lone_surrogate_is_a_refused_request_in_the_window(qtbot, make_window):  # noqa: F811
    from engine import SamplingParams
    from kvscope.ui.worker import InjectSpec

    win = loaded(qtbot, make_window())
    win.inject([InjectSpec("bad \udcff text", SamplingParams(max_tokens=4))])
    qtbot.waitUntil(lambda: win.banner.isVisible(), timeout=10_000)
    assert "request refused" in win.banner.text() and "lone surrogate" in win.banner.text()
    assert win.isVisible() and win.act_step.isEnabled()
