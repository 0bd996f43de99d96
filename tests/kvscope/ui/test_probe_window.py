"""The main window on a probed vLLM (its real scheduler, stepped by the harness): it opens in Run on vLLM's pool,
its Pause holds vLLM's scheduler, its Step runs exactly one schedule, and closing it while vLLM is held lets vLLM
run on."""

from __future__ import annotations

import time

from ports import free_port, free_ports
from PySide6.QtCore import QSettings
from vllm_live import CONTROL, Harness, need_vllm

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
        # all three admitted (a busy machine may show a step where the third still waits for its blocks)
        qtbot.waitUntil(
            lambda: win.latest is not None and sum(r.status == "RUNNING" for r in win.latest.snapshot.requests) == 3,
            timeout=20_000,
        )
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
    port = free_ports(2)[0]
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
        status = win.status_label.toolTip()  # the whole line (the label shows a short form where it does not fit)
        assert "free 39/39 blocks usable (1 reserved: vLLM's null block)" in status
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


def _healed_leak_trace(path) -> None:
    """A probe trace (no vLLM needed) where block 1 is leaked at step 2 and freed at step 3: the pool heals."""
    from kvscope.sources.probe import ProbeTraceWriter
    from kvscope_vllm_probe.wire import OP_POP, OP_PREPEND, OP_REF, OP_REQUEST, Keyframe, PoolInfo, RequestRow, Step
    from kvscope_vllm_probe.wire import encode as enc

    n = 8
    info = PoolInfo("m", "0.32.0", 4, n, 0, True, "sha256", 1, False, 2048, "")
    w = ProbeTraceWriter(str(path), {"endpoint": "test"})
    w.message(enc(Keyframe(0, 0, info, [0] * n, [], [], list(range(1, n)), [], [], False, "", {})))
    row = RequestRow("a", "RUNNING", 6, 0, [1, 2, 3, 4, 5, 6], 6, 0, 0, [1], 1.0)
    steps = [
        Step(1, 1, 0.01, [[OP_REQUEST, "a"], [OP_POP, [1]], [OP_REF, 1, 1]], [row], [], None, {}, False),
        Step(2, 2, 0.01, [], [], [("a", "FINISHED_STOPPED")], None, {}, False),  # its block not freed: a leak
        Step(3, 3, 0.01, [[OP_REF, 1, 0], [OP_PREPEND, [1]]], [], [], None, {}, False),  # freed late: healed
        Step(4, 4, 0.01, [], [], [], None, {}, False),
    ]
    for st in steps:
        w.message(enc(st))
    w.close()


def test_the_window_keeps_a_runs_audit_problems_after_the_pool_heals(qtbot, tmp_path):
    from kvscope.sources.probe import ProbeReplay

    trace = tmp_path / "healed.probe.jsonl"
    _healed_leak_trace(trace)
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
    win = MainWindow(lambda _scenario: ProbeReplay(str(trace)), settings)
    qtbot.addWidget(win)
    win.show()
    win.start()
    qtbot.waitUntil(lambda: win.info is not None, timeout=30_000)
    win.step(10)
    qtbot.waitUntil(lambda: win.latest is not None and win.latest.step == 4, timeout=20_000)
    win.flush()
    assert win.latest.audit.ok  # the pool is clean at the end ...
    assert win.run_audit.problem_steps() == [2]  # ... and the run's record keeps step 2's leak
    assert win.banner.isVisible() and win.banner.kind == "warning"
    assert "problems on 1 step of this run (the first at step 2: block 1: leaked" in win.banner.text()
    win.show_step(2)  # the timeline there: the leak red again, as it was
    win.flush()
    assert win.grid.leaked_set == {1}
    win.shutdown()
