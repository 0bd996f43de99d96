"""The prefix-forest view and the attach panel, offscreen, from a model built out of wire events."""

from __future__ import annotations

import numpy as np

from engine.inspect.kv_events import WireRemoved, WireStored
from kvscope.sources.attached import CANNOT_SHOW, AttachConfig, _Applier
from kvscope.sources.remote_cache import RemoteCacheModel
from kvscope.ui.views.prefix_forest import AttachPanel, PrefixForestView, layout_forest


def forest() -> RemoteCacheModel:
    """dp 0 GPU: a shared 2-block prefix with two continuations and a second prompt; dp 1 CPU: one chain."""
    m = RemoteCacheModel()
    m.apply(WireStored((1, 2), None, (10, 11, 12, 13), 2), dp_rank=0)
    m.apply(WireStored((3,), 2, (14, 15), 2), dp_rank=0)
    m.apply(WireStored((4,), 2, (16, 17), 2), dp_rank=0)
    m.apply(WireStored((5,), None, (20, 21), 2), dp_rank=0)
    m.apply(WireStored((7,), 6, (30, 31), 2), dp_rank=0)  # parent 6 never stored: an orphan
    m.apply(WireStored((8, 9), None, (40, 41, 42, 43), 2, "CPU"), dp_rank=1)
    return m


def test_model_chains_orphans_and_evictions():
    m = forest()
    s = m.summary()
    assert (s.blocks, s.tokens, s.roots) == (8, 16, 4)
    assert m.nodes[(0, "GPU", 3)].parent == 2 and m.nodes[(0, "GPU", 4)].token_ids == (16, 17)
    m.apply(WireRemoved((2,)), dp_rank=0)  # evict the middle of the chain: 3 and 4 become orphans
    assert m.roots[(0, "GPU")] == {1, 3, 4, 5, 7}
    m.apply(WireStored((2,), 1, (12, 13), 2), dp_rank=0)  # it comes back: they hang under it again
    assert m.roots[(0, "GPU")] == {1, 5, 7} and m.children[(0, "GPU", 2)] == {3, 4}
    m.apply(WireStored((6,), None, (0, 0), 2), dp_rank=0)
    assert 7 not in m.roots[(0, "GPU")]


def test_view_draws_every_node_with_its_labels_and_tokens(qtbot):
    m = forest()
    view = PrefixForestView(decode=lambda ids: "".join(chr(ord("a") + i % 26) for i in ids))
    qtbot.addWidget(view)
    view.set_model(m)
    view.show()
    assert view.node_count() == len(m.nodes) == 8
    assert view.band_labels() == ["dp 0 · GPU · 6 blocks", "dp 1 · CPU · 2 blocks"]
    x, y = view.scatter.getData()
    assert len(x) == 8
    lay = view._layout
    i3 = next(i for i, n in enumerate(lay.nodes) if n.key == (0, "GPU", 3))
    text = view.node_text(i3)
    assert "depth 2" in text and "tokens [14, 15]" in text and repr("op") in text
    orphan = next(i for i, n in enumerate(lay.nodes) if n.key == (0, "GPU", 7))
    assert "parent not cached" in view.node_text(orphan)
    assert "1 orphan(s)" in view.info.text()
    # Parents sit at their children's mean, the two bands do not overlap, the edges join parent and child.
    pos = {n.key: (lay.x[i], lay.y[i]) for i, n in enumerate(lay.nodes)}
    assert pos[(0, "GPU", 2)][1] == np.mean([pos[(0, "GPU", 3)][1], pos[(0, "GPU", 4)][1]])
    assert max(p[1] for k, p in pos.items() if k[0] == 1) < min(p[1] for k, p in pos.items() if k[0] == 0)
    assert len(lay.edges) == 2 * 4  # 1-2, 2-3, 2-4, 8-9


def test_view_bounds_what_it_draws(qtbot):
    m = RemoteCacheModel()
    for i in range(300):
        m.apply(WireStored((i,), i - 1 if i % 10 else None, (i, i), 2), dp_rank=0)
    view = PrefixForestView(max_nodes=100)
    qtbot.addWidget(view)
    view.set_model(m)
    assert view.node_count() == 100 and "showing 100 of 300" in view.info.text()
    deep = layout_forest(m.snapshot(limit=10_000))  # a deep chain lays out without recursion
    assert deep.x.max() == 9


def test_attach_panel_shows_a_record_and_what_attach_cannot_show(qtbot):
    from engine.inspect.kv_wire import encode_batch

    a = _Applier(AttachConfig("tcp://127.0.0.1:1"), None)
    a.apply(0, 0, encode_batch([WireStored((1, 2), None, (1, 2, 3, 4), 2)], 0.0), "live", 0)
    a.gap(0, 1, 3, "no replay endpoint")
    rec = a.finish_tick(1.0)
    panel = AttachPanel({"model_name": "attached to tcp://127.0.0.1:1", "cannot_show": CANNOT_SHOW})
    qtbot.addWidget(panel)
    panel.show_record(rec, a.model)
    assert "ref counts" in panel.banner.text() and "block tables" in panel.banner.text()
    assert panel.forest.node_count() == 2
    assert "1 unrepaired gap(s), 3 batch(es) missing" in panel.status.text()
    assert panel.events.model.rowCount() == 2  # two stored blocks in the event log


def test_the_attach_window_replays_a_trace_and_saves_a_screenshot(qtbot, tmp_path):
    from engine.inspect.kv_wire import encode_batch
    from kvscope.sources.attach_trace import AttachTraceWriter
    from kvscope.sources.attached import AttachReplay
    from kvscope.ui.poll_driver import PollDriver
    from kvscope.ui.views.prefix_forest import AttachWindow

    trace = tmp_path / "t.jsonl"
    a = _Applier(AttachConfig("tcp://127.0.0.1:1"), AttachTraceWriter(trace, {"endpoints": ["tcp://127.0.0.1:1"]}))
    for i in range(4):
        a.apply(0, i, encode_batch([WireStored((10 + i,), 10 + i - 1 if i else None, (i, i), 2)], 0.0), "live", 0)
        a.finish_tick(float(i))
    a.trace.close()
    win = AttachWindow(AttachReplay(str(trace)))
    qtbot.addWidget(win)
    png = tmp_path / "attach.png"
    driver = PollDriver(win, win.source, 0.01, steps=None, screenshot=str(png))
    driver.start()
    qtbot.waitUntil(lambda: png.exists(), timeout=10_000)
    assert driver.taken == 4 and driver.exit_code == 0
    assert win.panel.forest.node_count() == 4 and win.panel.forest.band_labels() == ["dp 0 · GPU · 4 blocks"]


def test_the_attach_timeline_rebuilds_the_forest_at_any_poll(tiny_engine):
    """Each poll's forest, rebuilt from a keyframe and the operations since, equals the one the poll left."""
    from engine import SamplingParams
    from kvscope.runtime.build import KVEventsObserver
    from kvscope.runtime.kv_events_options import KVEventsConfig
    from kvscope.runtime.kv_publisher import KVEventPublisher
    from kvscope.sources.attach_history import AttachHistory
    from kvscope.sources.attached import AttachConfig, AttachedSource
    from kvscope.sources.endpoints import connectable
    from kvscope.sources.live import LiveSource

    engine = tiny_engine(num_gpu_blocks=20, block_size=4)
    session = LiveSource(engine)
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"), 4)
    session.observers.append(KVEventsObserver(pub))
    src = AttachedSource(AttachConfig(connectable(pub.endpoint), connectable(pub.replay_endpoint), block_size=4))
    hist = AttachHistory(keyframe_every=3)
    truth = {}
    try:
        for i in range(30):
            if i % 3 == 0:
                session.inject(
                    list(range(10, 18)) + [i + 1, i + 2, i + 3, i + 4, i + 5],
                    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                )
            if i == 20 and not engine.has_unfinished():
                session.reset_prefix_cache()
            if session.has_work():
                session.step()
            rec = src.poll(0.5)
            hist.record(rec, src.model)
            truth[rec.tick] = {k: n.token_ids for k, n in src.model.nodes.items()}
        assert len({len(v) for v in truth.values()}) > 3  # the forest grew and shrank
        for tick, nodes in truth.items():
            model = hist.at(tick)
            assert {k: n.token_ids for k, n in model.nodes.items()} == nodes, tick
    finally:
        session.close()
        src.close()
