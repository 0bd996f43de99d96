"""A window left open on a served engine: every store that grows with steps, requests or events stays
within its bound (``kvscope.limits``), the timeline's budget counts what it really holds, and reaching a
bound never drops what is on screen (the live step, the selected request, the rows in view)."""

from __future__ import annotations

import gc
import random
import sys
import tracemalloc
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.request_groups import MAX_FINISHED
from kvscope.diagnosis import Diagnosis
from kvscope.history import RunHistory
from kvscope.limits import LIMITS, WindowLimits, event_log_text
from kvscope.runtime.protocol import Stepped
from kvscope.runtime.wire import RecordDecoder, RecordEncoder
from kvscope.sources.live import LiveSource

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from snapshot_scale import deep_size  # noqa: E402

from common import install_fake_runner  # noqa: E402

BLOCKS, SEQS = 48, 8
SMALL = WindowLimits(
    timeline_bytes=600_000, timeline_requests=250, event_log_rows=3_000, miss_explanations=150, evicted_blocks=200
)


def the_present(h: RunHistory) -> list:
    """What the history refers to that is the engine's present, not its past: the newest record and the
    rows shown now (the window holds them anyway)."""
    out = [h._latest, h.decode]
    for tl in h.requests.values():
        out += [tl.last, tl.last_key]
    return out


class Served:
    """A served engine's steps as the window receives them: requests arriving (shared prefixes) and finishing,
    some aborted; each step through the wire (a digest, and every 16th whole). The fake runner gives no
    logits to fork samples from, so n = 1."""

    def __init__(self, engine, seed: int = 0) -> None:
        install_fake_runner(engine)  # the scheduler, pool and prefix cache run for real
        self.engine, self.src = engine, LiveSource(engine)
        self.src.raw_snapshots = True  # as the engine process runs it
        self.enc, self.dec = RecordEncoder(), RecordDecoder()
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(1, 256) for _ in range(k)] for k in (8, 16, 24)]
        self.n = 0

    def _through_wire(self, rec, whole: bool) -> list[Stepped]:
        self.enc.add(Stepped(rec, None))
        return self.dec.decode(self.enc.flush(), whole)

    def steps(self, count: int):
        rng = self.rng
        for i in range(count):
            while len(self.engine.requests) < SEQS and rng.random() < 0.7:
                prompt = (rng.choice(self.prefixes) if rng.random() < 0.6 else []) + [
                    rng.randrange(1, 256) for _ in range(rng.randint(1, 12))
                ]
                self.src.inject(prompt, SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0, ignore_eos=True))
                self.n += 1
                yield from self._through_wire(self.src.current(), True)
            if rng.random() < 0.03 and self.engine.requests:
                self.src.abort(rng.choice(sorted(self.engine.requests)))
                yield from self._through_wire(self.src.current(), True)
            yield from self._through_wire(self.src.step(), i % 16 == 0)


def test_every_store_of_the_window_stays_within_its_bound(tiny_engine):
    served = Served(tiny_engine(block_size=4, num_gpu_blocks=BLOCKS, max_num_seqs=SEQS))
    history = RunHistory(SMALL.timeline_bytes, max_requests=SMALL.timeline_requests)
    diagnosis = Diagnosis(limits=SMALL)
    rows_seen = stored = 0
    from kvscope.ui.qt_models import EventLogModel  # Qt-free in use: a model needs no application

    log = EventLogModel(SMALL.event_log_rows)
    for st in served.steps(3_000):
        rec = st.record
        history.record(rec.snapshot, rec.seconds, None, rec.events)
        diagnosis.feed(rec.step, rec.events, rec.snapshot)
        log.extend([(rec.step, e) for e in rec.events])
        stored += sum(type(e).__name__ == "BlockStored" for e in rec.events)
        rows_seen = max(rows_seen, len(served.dec.rows))
        if rec.step % 25:
            continue
        n = history.store_lengths()
        assert history.nbytes <= history.budget_bytes and n["requests"] <= SMALL.timeline_requests
        assert n["series"] == n["steps"] == n["counters"] == n["shown"] and n["event_steps"] <= n["steps"]
        assert n["ttft"] <= n["requests"] and n["keyframes"] <= n["steps"]
        m = diagnosis.misses
        assert len(m.misses) <= SMALL.miss_explanations and m.num_evicted <= SMALL.evicted_blocks
        assert len(m.mirror) <= BLOCKS and len(m.ref) <= BLOCKS
        assert len(log.rows) <= SMALL.event_log_rows
    # every bound was reached, and what came past it went
    assert served.n > 4 * SMALL.timeline_requests
    assert history.dropped_steps > 0 and history.dropped_requests > 0
    assert diagnosis.misses.dropped > 0 and log.dropped > 0
    assert history.store_lengths()["stored_values"] < stored / 3  # values no step in reach shows went
    assert rows_seen <= MAX_FINISHED + 2 * SEQS + 2  # the rows a snapshot carries: the engine bounds them
    # the live step is always in reach, and every step in reach still rebuilds
    first, last = history.reach
    assert last == served.engine.step_count and history.at(last).step == last
    assert history.at(first) is not None and history.at(first - 1) is None
    # the budget counts what the history really holds (object by object, the present excluded)
    held = deep_size(history, the_present(history))
    assert held <= history.nbytes <= 1.3 * held


def test_a_long_run_holds_flat_memory(tiny_engine):
    """Measured by the process (tracemalloc): after the bounds are reached, the window's stores stop growing."""
    served = Served(tiny_engine(block_size=4, num_gpu_blocks=BLOCKS, max_num_seqs=SEQS), seed=1)
    history = RunHistory(SMALL.timeline_bytes, max_requests=SMALL.timeline_requests)
    diagnosis = Diagnosis(limits=SMALL)
    steps = served.steps(4_500)
    for st in steps:  # past every bound first
        history.record(st.record.snapshot, st.record.seconds, None, st.record.events)
        diagnosis.feed(st.record.step, st.record.events, st.record.snapshot)
        if st.record.step >= 1_500:
            break
    gc.collect()
    tracemalloc.start()
    try:
        traced: dict[int, int] = {}
        for st in steps:
            history.record(st.record.snapshot, st.record.seconds, None, st.record.events)
            diagnosis.feed(st.record.step, st.record.events, st.record.snapshot)
            if st.record.step % 250 == 0 and st.record.step not in traced:
                gc.collect()
                traced[st.record.step] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    held = list(traced.values())
    assert len(held) >= 10 and history.dropped_steps > 3_000
    # 3,000 more steps (unbounded, ~4 MB more): what every store holds moves within the timeline's budget
    assert max(held) - min(held) < SMALL.timeline_bytes, traced


def test_the_selected_request_keeps_its_explanation_past_the_bound(tiny_engine):
    served = Served(tiny_engine(block_size=4, num_gpu_blocks=BLOCKS, max_num_seqs=SEQS), seed=2)
    diagnosis = Diagnosis(limits=SMALL)
    chosen = snap = None
    for st in served.steps(1_500):
        snap = st.record.snapshot
        diagnosis.feed(st.record.step, st.record.events, snap)
        if chosen is None and diagnosis.misses and diagnosis.misses.misses:
            chosen = next(iter(diagnosis.misses.misses))
            first_text = diagnosis.miss_text(_with(snap, chosen), chosen)  # asked: it is the selected one
    assert diagnosis.misses.dropped > 0 and chosen in diagnosis.misses.misses
    assert diagnosis.miss_text(_with(snap, chosen), chosen) == first_text
    other = next(iter(diagnosis.misses.misses.keys() - {chosen}))
    diagnosis.miss_text(snap, "")  # the selection cleared: nothing is kept any more
    for st in served.steps(600):
        diagnosis.feed(st.record.step, st.record.events, st.record.snapshot)
    assert chosen not in diagnosis.misses.misses and other not in diagnosis.misses.misses
    assert "no longer kept" in diagnosis.miss_text(_with(snap, chosen, "FINISHED_LENGTH"), chosen)


def _with(snap, rid: str, status: str = "RUNNING"):
    """A snapshot that shows request ``rid`` (for ``miss_text``, which reads its row)."""
    from engine.inspect.snapshot import RequestInfo

    class One:
        block_size = snap.block_size

        def request(self, r):
            return (
                RequestInfo(rid, 0, status, 8, 1, 0, 8, (), "", tuple(range(9)), None, rid, None, ())
                if r == rid
                else None
            )

    return One()


def test_the_limits_have_defaults_and_lines():
    assert LIMITS.timeline_bytes > 0 and LIMITS.event_log_rows == 100_000
    assert event_log_text() == "event log: last 100,000 events"
    assert RunHistory().budget_bytes == LIMITS.timeline_bytes
    assert RunHistory().max_requests == LIMITS.timeline_requests


# -- the views: a bound reached never moves what is on screen ---------------------------------------------
@pytest.fixture
def log_view(qtbot):
    from kvscope.ui.views.event_log import EventLogView

    view = EventLogView(max_rows=500)
    qtbot.addWidget(view)
    view.resize(600, 300)
    view.show()
    qtbot.waitExposed(view)
    return view


def _events(n: int, start: int):
    from engine.inspect.events import BlockAllocated

    return [BlockAllocated(block_id=start + i, request_id="r") for i in range(n)]


def test_the_event_log_keeps_its_bound_and_the_rows_in_view(log_view):
    assert log_view.bound_label.text() == "event log: last 500 events"
    for s in range(10):  # following the end: the oldest go
        log_view.append(s, _events(100, 100 * s))
        log_view.flush()
    assert len(log_view.model.rows) == 500 and log_view.model.dropped == 500
    assert "500 dropped" in log_view.bound_label.toolTip()
    log_view.table.scrollToTop()  # looking back: the rows on screen stay, and stay in view
    top = log_view.model.rows[log_view.first_visible_row()][1]
    for s in range(10, 14):
        log_view.append(s, _events(100, 100 * s))
        log_view.flush()
    assert log_view.model.rows[log_view.first_visible_row()][1] is top
    assert len(log_view.model.rows) <= 2 * 500  # held past the bound while looked at, never past twice it
    for s in range(14, 30):
        log_view.append(s, _events(100, 100 * s))
        log_view.flush()
    assert len(log_view.model.rows) <= 1_000


def test_a_selected_request_stays_selected_and_in_the_table(qtbot):
    import numpy as np

    from engine.inspect.snapshot import RequestInfo
    from kvscope.ui.views.request_panel import RequestPanel

    class Snap:
        def __init__(self, rows):
            self.requests, self.ref_cnt = tuple(rows), np.zeros(8, np.int32)
            self.state = np.zeros(8, np.uint8)  # every block free: the block table colours by state

        def request(self, rid):
            return next((r for r in self.requests if r.request_id == rid), None)

    def row(rid, status="RUNNING"):
        return RequestInfo(rid, 0, status, 4, 1, 0, 4, (1,), "x", (1, 2, 3, 4, 5), None, rid, None, ())

    panel = RequestPanel()
    qtbot.addWidget(panel)
    chosen = []
    panel.request_selected.connect(chosen.append)
    panel.set_snapshot(Snap([row("a"), row("b")]))
    panel.select(["b"])
    panel.set_snapshot(Snap([row("c"), row("b", "FINISHED_STOPPED")]))  # other rows: still selected
    assert panel.selected_ids() == ["b"] and chosen == ["b"]
    panel.set_snapshot(Snap([row("c"), row("d")]))  # the engine let it go: it stays, as it last was
    assert panel.selected_ids() == ["b"] and [r.request_id for r in panel.model.rows] == ["c", "d", "b"]
    assert panel.model.index(2, panel.model.HEADERS.index("state")).data() == "finished: stop (kept: selected)"
    panel.select([])
    panel.set_snapshot(Snap([row("e")]))
    assert [r.request_id for r in panel.model.rows] == ["e"] and chosen[-1] == ""


def test_each_bound_is_a_flag_of_the_window(qtbot, tmp_path):
    from PySide6.QtCore import QSettings

    from kvscope.cli.parser import build_parser, window_limits
    from kvscope.ui.main_window import MainWindow

    args = build_parser().parse_args(
        [
            "--timeline-mib",
            "8",
            "--timeline-requests",
            "300",
            "--event-log-rows",
            "500",
            "--miss-explanations",
            "40",
            "--evicted-blocks",
            "60",
        ]
    )
    limits = window_limits(args)
    assert limits == WindowLimits(8 * 2**20, 300, 500, 40, 60)
    assert window_limits(build_parser().parse_args([])) == LIMITS  # the defaults are the limits' own
    win = MainWindow(lambda _s: None, QSettings(str(tmp_path / "k.ini"), QSettings.Format.IniFormat), limits=limits)
    qtbot.addWidget(win)
    assert win.history.budget_bytes == 8 * 2**20 and win.history.max_requests == 300
    assert win.events.model.max_rows == 500 and win.events.bound_label.text() == "event log: last 500 events"
    assert win.diagnosis.limits is limits
