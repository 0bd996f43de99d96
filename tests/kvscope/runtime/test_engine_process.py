"""The engine in its own process: same results as on a thread, and a crash, a hang or a close handled."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QSettings, QTimer

from engine import EngineConfig, SamplingParams
from engine.inspect.trace import replay_trace
from kvscope.runtime.build import SourceSpec
from kvscope.sources.base import InjectSpec
from kvscope.ui.main_window import MainWindow
from kvscope.ui.worker import ProcessBackend

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(10, 30)) + [1, 2], list(range(10, 30)) + [3]]


@pytest.fixture
def settings(tmp_path):
    return QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)


@pytest.fixture
def process_window(open_window, settings, tiny_dir):
    """Windows on the tiny Llama's folder, in an engine process."""

    def make(trace: str | None = None, hang_timeout_s: float = 15.0, **kw) -> MainWindow:
        kw.setdefault("num_gpu_blocks", 48)
        kw.setdefault("block_size", 4)
        spec = SourceSpec(EngineConfig(model=tiny_dir, **kw), trace=trace)
        return open_window(ProcessBackend(spec, hang_timeout_s=hang_timeout_s), settings=settings, timeout_ms=90_000)

    return make


def drive(qtbot, win: MainWindow, steps: int) -> None:
    win.inject([InjectSpec(p, GREEDY) for p in PROMPTS])
    qtbot.waitUntil(lambda: len(win.latest.snapshot.requests) == len(PROMPTS), timeout=20_000)
    target = win.latest.step + steps
    win.step(steps)
    qtbot.waitUntil(lambda: win.latest.step >= target, timeout=30_000)
    win.flush()


def test_same_snapshots_as_an_engine_in_this_process(qtbot, process_window, tiny_engine, tiny_dir):
    win = process_window()
    assert win.worker.pid != os.getpid() and win.worker.is_running
    drive(qtbot, win, 6)
    from engine import LLMEngine
    from kvscope.sources.live import LiveSource

    here = LiveSource(LLMEngine(EngineConfig(model=tiny_dir, num_gpu_blocks=48, block_size=4)))
    for p in PROMPTS:
        here.inject(p, GREEDY)
    for _ in range(6):
        rec = here.step()
    shown = win.latest.snapshot
    for f in ("state", "ref_cnt", "owner", "has_hash", "filled", "free_queue"):
        assert np.array_equal(getattr(shown, f), getattr(rec.snapshot, f)), f
    assert shown.requests == rec.snapshot.requests
    assert dict(shown.cached_tokens) == dict(rec.snapshot.cached_tokens)
    assert np.array_equal(win.grid.grid.ravel()[:48], shown.state)


def test_a_killed_engine_leaves_the_window_alive_and_restarts(qtbot, process_window, tmp_path):
    trace = tmp_path / "run.trace"
    win = process_window(trace=str(trace))
    drive(qtbot, win, 4)
    last = win.latest
    pid = win.worker.pid
    os.kill(pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: win.banner.isVisible() and "SIGKILL" in win.banner.text(), timeout=10_000)
    assert win.latest is last  # the last state stays on screen
    assert not win.act_step.isEnabled() and win.act_restart.isEnabled()
    ticks = []
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append(1))
    timer.start(10)
    qtbot.waitUntil(lambda: len(ticks) >= 5, timeout=2000)  # the event loop runs
    timer.stop()
    # The trace so far stays readable.
    steps = [r.step for r in replay_trace(trace)]
    assert steps and max(steps) == last.step
    win.restart_engine()
    qtbot.waitUntil(
        lambda: win.act_step.isEnabled() and win.latest is not None and win.latest.step == 0, timeout=90_000
    )
    assert win.worker.pid != pid
    drive(qtbot, win, 2)
    assert win.latest.snapshot.counters["num_requests_running"] == 2


def test_a_hung_engine_is_reported_and_can_be_replaced(qtbot, process_window):
    win = process_window(hang_timeout_s=1.5)
    pid = win.worker.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        qtbot.waitUntil(
            lambda: win.banner.isVisible() and "stopped responding" in win.banner.text(), timeout=30_000
        )  # the watchdog ticks on the window's loop: slow on a loaded machine
    finally:
        os.kill(pid, signal.SIGCONT)
    win.restart_engine()
    qtbot.waitUntil(lambda: win.act_step.isEnabled() and win.worker.pid != pid, timeout=90_000)
    qtbot.waitUntil(lambda: win.latest is not None and win.latest.step == 0, timeout=30_000)


def test_closing_the_window_ends_the_engine_process_and_frees_shared_memory(qtbot, process_window):
    win = process_window()
    drive(qtbot, win, 2)
    proc = win.worker.proc
    names = [s.name for s in win.worker._slots.shms]
    assert all(Path("/dev/shm", n.lstrip("/")).exists() for n in names)
    t0 = time.perf_counter()
    win.close()
    assert time.perf_counter() - t0 < 10
    assert proc.exitcode == 0
    assert not any(Path("/dev/shm", n.lstrip("/")).exists() for n in names)


def test_an_engine_spawned_before_the_window_is_adopted(qtbot, settings, tiny_dir):
    """kvscope spawns the engine process before importing Qt; the window takes that very process over."""
    from kvscope.runtime import protocol as p
    from kvscope.runtime.engine_process import spawn_engine

    spec = SourceSpec(EngineConfig(model=tiny_dir, num_gpu_blocks=48, block_size=4))
    early = spawn_engine(spec, 30, p.Load(None))
    win = MainWindow(ProcessBackend(spec, early=early), settings)
    qtbot.addWidget(win)
    win.show()
    win.start()
    try:
        qtbot.waitUntil(lambda: win.info is not None and win.latest is not None, timeout=90_000)
        assert win.worker.pid == early.proc.pid
        drive(qtbot, win, 3)
        assert all(r.num_computed_tokens > 0 for r in win.latest.snapshot.requests)
    finally:
        win.shutdown()


def test_an_early_engine_for_another_spec_is_stopped_not_used(qtbot, settings, tiny_dir):
    from kvscope.runtime import protocol as p
    from kvscope.runtime.engine_process import spawn_engine

    spec = SourceSpec(EngineConfig(model=tiny_dir, num_gpu_blocks=48, block_size=4))
    early = spawn_engine(SourceSpec(EngineConfig(model=tiny_dir, num_gpu_blocks=20)), 30, p.Load(None))
    win = MainWindow(ProcessBackend(spec, early=early), settings)
    qtbot.addWidget(win)
    win.show()
    win.start()
    try:
        qtbot.waitUntil(lambda: win.info is not None and win.latest is not None, timeout=90_000)
        assert win.worker.pid != early.proc.pid and win.info.num_blocks == 48
        early.proc.join(10)
        assert not early.proc.is_alive()
    finally:
        win.shutdown()


def test_pause_at_full_speed_stops_the_engine_process_at_once(qtbot, process_window):
    """At "max" the engine process's next tick is always due: it must still read the pipe between batches
    (a Pause, and the window's releases of the shared-memory slots)."""
    win = process_window(num_gpu_blocks=256)
    # as long as the tiny model's 512 positions allow: the window reads the steps behind the engine (under load,
    # a few hundred behind at "max"), and the pause must still find this request running
    long = SamplingParams(max_tokens=490, temperature=0.0, ignore_eos=True)
    win.inject([InjectSpec(list(range(10, 30)), long)])
    qtbot.waitUntil(lambda: len(win.latest.snapshot.requests) == 1, timeout=20_000)
    batches = []
    dec = win.worker._decoder
    real = dec.decode  # every batch is decoded (its last step whole or digested)
    dec.decode = lambda b, whole=True: (batches.append(b), real(b, whole))[1]
    win.speed.setCurrentText("max")
    win.act_run.trigger()
    start = win.latest.step
    qtbot.waitUntil(lambda: win.latest.step >= start + 120, timeout=30_000)
    win.act_run.trigger()
    qtbot.waitUntil(lambda: not win.running, timeout=5000)
    time.sleep(0.3)  # batches the engine sent before it paused still arrive; no message says which was last
    win.flush()
    paused_at = win.latest.step
    assert win.latest.snapshot.request(win.latest.snapshot.requests[0].request_id).status == "RUNNING"
    qtbot.wait(300)
    win.flush()
    assert win.latest.step == paused_at  # paused with work left, not at the end of the run
    # the arrays came through shared memory, not pickled through the pipe (which a batch falls back to
    # only while the window still holds every slot)
    sent = [b for b in batches if b.has_arrays]
    assert len(sent) >= 4 and sum(b.inline is not None for b in sent) < len(sent) / 2
    # steps went together (a batch every BATCH_S), and every step reached the window
    assert sum(len(b.steps) for b in batches) >= 120 > len(batches)
    assert win.history.steps[-(paused_at - start) :] == list(range(start + 1, paused_at + 1))


def _fed_backend(tiny_engine, tiny_dir):
    """A ProcessBackend never started, fed by hand, over a live source in engine-process mode."""
    from kvscope.runtime import protocol as p
    from kvscope.sources.live import LiveSource

    src = LiveSource(tiny_engine(block_size=4, num_gpu_blocks=40))
    src.raw_snapshots = True
    backend = ProcessBackend(SourceSpec(EngineConfig(model=tiny_dir)))
    posted = []
    backend._post = posted.append
    backend._post_all = posted.extend
    backend._handle_other(p.Loaded(src.info, ()))  # creates the slots (the attach goes nowhere)
    src.inject(list(range(5, 19)), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    return src, backend, posted


def test_the_reader_keeps_the_newest_step_whole_and_digests_the_ones_before(qtbot, tiny_engine, tiny_dir):
    """Only the newest step is drawn: every step of a batch another batch follows is digested (rows,
    counters, blocks per state), and so are all but the last of every batch; a batch's last step is kept
    whole when it is the newest, the first after a load, a command's, or WHOLE_EVERY steps after the last
    one kept whole (the timeline's keyframes). The window's history stays exact either way."""
    from engine.inspect.snapshot import PoolState, StepDigest
    from kvscope.history import RunHistory
    from kvscope.runtime import protocol as p
    from kvscope.runtime.shm import ShmSlots
    from kvscope.runtime.wire import RecordEncoder
    from kvscope.sysinfo import MemoryReading
    from kvscope.ui.worker import WHOLE_EVERY

    src, backend, posted = _fed_backend(tiny_engine, tiny_dir)
    enc = RecordEncoder()
    enc.attach(ShmSlots.attach(backend._slots.spec))
    released = []
    backend.send = lambda cmd: released.append(cmd.slot)
    truth = {}

    def feed(steps: int, newest: bool) -> None:
        """A batch of ``steps`` steps (0: the record of the state now, as after a command)."""
        for _ in range(steps):
            rec = src.step()
            truth[rec.step] = src.engine.snapshot()  # taken before the next step changes it
            enc.add(p.Stepped(rec, MemoryReading()))
        if not steps:
            enc.add(p.Stepped(src.current(), MemoryReading()))
        b = enc.flush()
        backend._handle_batch(b, newest)
        if b.slot is not None:
            enc.release(b.slot)

    feed(0, False)  # the first record after the load (and a command's): whole
    per_batch, n = 3, 8
    for i in range(n):
        feed(per_batch, i == n - 1)
    try:
        snaps = [r.record.snapshot for r in posted[1:]]
        whole = [s.step for s in snaps if isinstance(s, PoolState)]
        first = snaps[0].step
        kept = first + per_batch * -(-WHOLE_EVERY // per_batch)  # the first batch end WHOLE_EVERY steps on
        assert whole == [first, kept, snaps[-1].step] and snaps[-1].step == first + per_batch * n
        assert all(isinstance(s, StepDigest) for s in snaps if s.step not in whole)
        assert len(released) == n + 1  # every slot was given back
        hist = RunHistory(keyframe_every=8)
        for r in posted[1:]:
            hist.record(r.record.snapshot, r.record.seconds, None, r.record.events)
        for step, snap in truth.items():
            got = hist.at(step)
            assert np.array_equal(got.state, snap.state) and got.requests == snap.requests
    finally:
        enc.detach()
        backend._slots.close()


def test_the_reader_digests_a_batch_only_when_another_batch_follows_it(qtbot, tiny_engine, tiny_dir):
    """Through a real pipe: batches followed by batches are digested; the last step of the batch before
    another message (the end of a run) and of the last before the pipe closes are kept whole; order is kept."""
    import multiprocessing as mp

    from engine.inspect.snapshot import PoolState, StepDigest
    from kvscope.runtime import protocol as p
    from kvscope.runtime.wire import RecordEncoder
    from kvscope.sysinfo import MemoryReading

    src, backend, posted = _fed_backend(tiny_engine, tiny_dir)
    backend._closing = True  # the pipe's end here is not a death
    backend.send = lambda cmd: None
    enc = RecordEncoder()  # no slots attached: the arrays travel inline
    ours, theirs = mp.Pipe(duplex=True)

    def batch(records) -> None:
        for rec in records:
            enc.add(p.Stepped(rec, MemoryReading()))
        ours.send(enc.flush())

    batch([src.current()])
    for size in (1, 2, 1, 3, 2):
        batch([src.step() for _ in range(size)])
    ours.send(p.RunningChanged(False))
    for size in (1, 1, 2):
        batch([src.step() for _ in range(size)])
    ours.close()
    backend._read(theirs)
    kinds = [
        (
            "run"
            if isinstance(r, p.RunningChanged)
            else "whole"
            if isinstance(r.record.snapshot, PoolState)
            else "digest"
            if isinstance(r.record.snapshot, StepDigest)
            else "?"
        )
        for r in posted[1:]
    ]
    assert kinds == ["whole"] + ["digest"] * 8 + ["whole", "run"] + ["digest"] * 3 + ["whole"]
    steps = [r.record.step for r in posted[1:] if not isinstance(r, p.RunningChanged)]
    assert steps == sorted(steps) and steps[-1] == src.step_count
    backend._slots.close()


def test_the_engine_process_leaves_a_core_to_the_window(monkeypatch):
    """The engine's CPU threads: one core fewer than the process may use (at least one), unless
    OMP_NUM_THREADS says otherwise; torch, once imported, is told too."""
    import torch

    from kvscope.runtime.engine_process import leave_a_core_to_the_window

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
        assert leave_a_core_to_the_window() == 3
        assert os.environ["OMP_NUM_THREADS"] == "3" and torch.get_num_threads() == 3
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        assert leave_a_core_to_the_window() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "6")
        assert leave_a_core_to_the_window() == 6  # the user's word stands
    finally:
        torch.set_num_threads(before)
