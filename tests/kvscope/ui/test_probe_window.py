"""The main window on a probed vLLM (its real scheduler, stepped by the harness): it opens in Run on vLLM's pool,
its Pause holds vLLM's scheduler, its Step runs exactly one schedule, and closing it while vLLM is held lets vLLM
run on."""

from __future__ import annotations

import time

from PySide6.QtCore import QSettings
from vllm_live import CONTROL, Harness, free_port, free_ports, need_vllm

from kvscope.sources.probe import ProbeSource
from kvscope.ui.main_window import MainWindow


def test_the_window_shows_holds_and_steps_a_probed_vllm(qtbot, tmp_path):
    need_vllm()
    ep = f"tcp://127.0.0.1:{free_port()}"
    with Harness(ep, num_blocks=48, env=CONTROL) as h:
        h.cmd("spin", on=True, pace=0.02)
        for i in range(3):
            h.cmd("add", id=f"chat-{i}", prompt=list(range(100, 164)) + [300 + i] * 9, max_tokens=2000)
        settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
        win = MainWindow(lambda _scenario: ProbeSource(ep, wait_s=30), settings)
        qtbot.addWidget(win)
        win.show()
        win.start()
        qtbot.waitUntil(lambda: win.info is not None and win.running, timeout=30_000)  # a live vLLM: in Run
        assert win.info.model_name.startswith("vLLM 0.") and win.info.num_blocks == 48
        qtbot.waitUntil(lambda: win.latest is not None and len(win.latest.snapshot.requests) == 3, timeout=20_000)
        win.flush()
        shared = win.latest.snapshot.ref_cnt[1:5].tolist()
        assert shared == [3, 3, 3, 3]  # the system prompt's 4 blocks, held by the three chats
        assert not win.act_inject.isEnabled()  # requests come through vLLM's own API
        assert win.audit_box.isChecked() and not win.audit_box.isEnabled()  # audited every step, always
        win.act_run.trigger()  # Pause: vLLM's scheduler is held at its next schedule
        qtbot.waitUntil(lambda: not win.running, timeout=5000)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            a = h.cmd("dump")["step"]
            time.sleep(0.3)
            if h.cmd("dump")["step"] == a:
                break
        held = h.cmd("dump")["step"]
        qtbot.waitUntil(lambda: win.latest.step >= held, timeout=10_000)  # what vLLM did before it stopped
        win.step(1)
        qtbot.waitUntil(lambda: h.cmd("dump")["step"] == held + 1 and win.latest.step == held + 1, timeout=15_000)
        time.sleep(0.5)
        assert h.cmd("dump")["step"] == held + 1  # exactly one schedule
        assert win.latest.audit is not None and win.latest.audit.ok
        win.shutdown()  # the window goes while vLLM is held
        deadline = time.monotonic() + 10
        while h.cmd("dump")["step"] == held + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert h.cmd("dump")["step"] > held + 1, "vLLM stayed held by a window that is gone"


def test_the_window_shows_one_data_parallel_rank_and_picks_another(qtbot, tmp_path):
    need_vllm()
    port = free_ports(2)
    base = f"tcp://127.0.0.1:{port}"
    env = {**CONTROL, "KVSCOPE_PROBE_DP_SIZE": "2"}  # two engine cores' schedulers, as --data-parallel-size 2 has
    with Harness(base, num_blocks=48, env=env, args=("--dp-rank", "0")) as h0:
        with Harness(base, num_blocks=32, env=env, args=("--dp-rank", "1")) as h1:
            for r, h in ((0, h0), (1, h1)):
                h.cmd("spin", on=True, pace=0.05)
                h.cmd("add", id=f"rank{r}-chat", prompt=list(range(100, 164)) + [300 + r] * 9, max_tokens=2000)
            settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
            win = MainWindow(lambda _scenario: ProbeSource(base, wait_s=30), settings)
            qtbot.addWidget(win)
            win.show()
            win.start()
            qtbot.waitUntil(lambda: win.info is not None and win.running, timeout=30_000)
            assert win.act_rank.isVisible() and win.rank_picker.currentText() == "DP rank 0 of 2"
            assert win.info.num_blocks == 48

            def requests() -> set[str]:
                return {q.request_id for q in win.latest.snapshot.requests} if win.latest is not None else set()

            qtbot.waitUntil(lambda: requests() == {"rank0-chat"}, timeout=20_000)
            win.rank_picker.setCurrentIndex(1)
            win.rank_picker.activated.emit(1)  # as a click on "DP rank 1 of 2"
            qtbot.waitUntil(lambda: win.info.extra["dp_rank"] == 1 and win.info.num_blocks == 32, timeout=15_000)
            qtbot.waitUntil(lambda: requests() == {"rank1-chat"}, timeout=20_000)
            assert win.rank_picker.currentText() == "DP rank 1 of 2" and win.latest.audit.ok
            win.flush()
            win.grab().save(str(tmp_path / "dp-rank-1.png"))
            win.shutdown()
