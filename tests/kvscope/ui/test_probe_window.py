"""The main window on a probed vLLM (its real scheduler, stepped by the harness): it opens in Run on vLLM's pool,
its Pause holds vLLM's scheduler, its Step runs exactly one schedule, and closing it while vLLM is held lets vLLM
run on."""

from __future__ import annotations

import time

from PySide6.QtCore import QSettings
from vllm_live import Harness, free_port, need_vllm

from kvscope.sources.probe import ProbeSource
from kvscope.ui.main_window import MainWindow


def test_the_window_shows_holds_and_steps_a_probed_vllm(qtbot, tmp_path):
    need_vllm()
    ep = f"tcp://127.0.0.1:{free_port()}"
    with Harness(ep, num_blocks=48) as h:
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


def test_a_hybrid_models_groups_and_vllms_null_block_in_the_window(qtbot, tmp_path):
    """A sliding-window + full-attention pool (vLLM's hybrid coordinator): the grid tells the groups apart (its
    "KV group" colour mode and legend, each block's hover line), a request's tables show one per group, the figure
    has a group picker; vLLM's null block is reserved: an idle pool counts 0 used, in the legend and the status."""
    need_vllm()
    ep = f"tcp://127.0.0.1:{free_port()}"
    with Harness(ep, num_blocks=40, args=("--groups", "sliding:32,full")) as h:
        settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
        win = MainWindow(lambda _scenario: ProbeSource(ep, wait_s=30), settings)
        qtbot.addWidget(win)
        win.show()
        win.start()
        qtbot.waitUntil(lambda: win.latest is not None, timeout=30_000)
        win.flush()
        idle = {e.name: e.count for e in win.grid.legend.entries}
        assert idle["used"] == 0 and idle["reserved"] == 1  # nothing runs: block 0 is vLLM's, not a request's
        assert "free 39/39 blocks" in win.status_label.text() and "1 reserved" in win.status_label.text()
        h.cmd("spin", on=True, pace=0.05)
        h.cmd("add", id="chat", prompt=list(range(100, 164)) + [7] * 9, max_tokens=2000)
        qtbot.waitUntil(lambda: any(0 in r.tables[0] for r in win.latest.snapshot.requests), timeout=30_000)
        win.flush()
        win.requests.select(["chat"])
        win.flush()
        rows = [win.requests.block_table.verticalHeaderItem(i).text() for i in range(2)]
        assert rows == ["group 0 · sliding window (32 tokens)", "group 1 · full attention"]
        assert win.requests.block_table.item(0, 0).text() == "–"  # a block the window gave back: the null block
        assert win.figure.group_box.isVisible() and win.figure.group == 1  # the full-attention group first
        win.figure.set_group(0)
        assert "sliding window" in win.figure.caption.text()
        win.grid.set_mode("KV group")
        names = [e.name for e in win.grid.legend.entries]
        assert names[:4] == ["no group", "reserved", "group 0: sliding window (32 tokens)", "group 1: full attention"]
        snap = win.latest.snapshot
        b = next(b for b in snap.request("chat").group_block_ids[1] if b)
        assert "group 1 (full attention)" in win.grid.describe(b)
        win.shutdown()
