"""Render every view from real snapshots into PNGs, to look at them (not a test).

    QT_QPA_PLATFORM=offscreen python scripts/view_gallery.py [--out /tmp/gallery] [--cache FILE]

Snapshots: the four-score and parallel-sampling scenarios on the embedded SmolLM2, and a
65,536-block pool on a tiny random Llama. ``--cache`` keeps them (and the tokens' text) in a
pickle so that re-rendering after a change to a view skips the model runs.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_scenario(model, tok, src, name: str) -> list[tuple]:
    from engine import EngineConfig, LLMEngine
    from kvscope.scenario import ScenarioRunner, load_scenario
    from kvscope.sources.live import LiveSource

    sc = load_scenario(name)
    engine = LLMEngine.from_hf_model(model, tok, EngineConfig(**sc.config), name=src.name)
    session = LiveSource(engine, ScenarioRunner(sc))
    recs = [(0, session.current().snapshot, [])]
    while session.has_work() and session.step_count < (sc.steps or 100):
        rec = session.step()
        recs.append((rec.step, rec.snapshot, list(rec.events)))
    session.close()
    return recs


def big_pool() -> tuple:
    from engine import LLMEngine, SamplingParams
    from tests.conftest import make_tiny_hf

    engine = LLMEngine.from_hf_model(make_tiny_hf(), None, name="tiny-llama", num_gpu_blocks=65_536, block_size=16)
    shared = list(range(1, 49))
    for i in range(12):
        engine.add_request(
            shared + [50 + i] * (5 + 7 * i), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        )
    snaps = []
    for _ in range(10):
        engine.step()
    snaps.append(engine.snapshot())
    return snaps[-1]


def collect(cache: str | None) -> dict:
    if cache and Path(cache).is_file():
        return pickle.loads(Path(cache).read_bytes())
    import torch

    from engine.runner.models.loader import embedded_source, load_hf_model

    src = embedded_source()
    model, tok = load_hf_model(src, "auto", torch.device("cpu"))
    data = {name: run_scenario(model, tok, src, name) for name in ("four-score", "parallel-sampling")}
    ids = {t for recs in data.values() for _, s, _ in recs for r in s.requests for t in r.token_ids}
    data["vocab"] = {t: tok.decode([t]) for t in ids}
    data["big"] = big_pool()
    if cache:
        Path(cache).write_bytes(pickle.dumps(data))
    return data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gallery")
    ap.add_argument("--cache", default=None)
    args = ap.parse_args()
    data = collect(args.cache)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from PySide6.QtCore import QPointF
    from PySide6.QtWidgets import QApplication

    from kvscope.ui.style import apply_style

    app = QApplication.instance() or QApplication([])
    apply_style(app)
    from kvscope.history import RunHistory
    from kvscope.scenario import load_scenario
    from kvscope.ui.views.banner import Banner
    from kvscope.ui.views.block_grid import BlockGridView
    from kvscope.ui.views.event_log import EventLogView
    from kvscope.ui.views.figure_view import FigureView
    from kvscope.ui.views.inject_dialog import InjectDialog
    from kvscope.ui.views.legend import LegendView
    from kvscope.ui.views.plots import PlotsPanel
    from kvscope.ui.views.request_panel import RequestPanel
    from kvscope.ui.views.scenario_notes import ScenarioNotesPanel
    from kvscope.ui.views.welcome import WelcomeView

    vocab = data["vocab"]

    def decode(ids):
        return "".join(vocab.get(int(t), f"<{t}>") for t in ids)

    def save(widget, name: str, w: int, h: int) -> None:
        widget.resize(w, h)
        widget.show()
        for _ in range(3):
            app.processEvents()
        widget.grab().save(str(out / f"{name}.png"))
        print(out / f"{name}.png")

    def at(name: str, step: int):
        return next((s, ev) for st, s, ev in data[name] if st == step)

    # The paper's figures.
    fig = FigureView()
    fig.set_decode(decode)
    for step, rids, name in (
        (1, ["0"], "fig4_step1_prefill"),
        (2, ["0"], "fig4_step2_decode1"),
        (3, ["0"], "fig4_step3_new_block"),
        (5, ["0", "1"], "fig5_two_requests_step5"),
    ):
        snap, ev = at("four-score", step)
        fig.set_snapshot(snap)
        fig.set_events(ev)
        fig.set_requests(rids)
        save(fig, name, 1200 if len(rids) == 2 else 900, 420)
    for step, name in ((1, "fig6_cow_step1_shared"), (2, "fig6_cow_step2_copied"), (4, "fig6_cow_step4")):
        snap, ev = at("parallel-sampling", step)
        fig.set_snapshot(snap)
        fig.set_events(ev)
        fig.set_requests(["0", "0#1"])
        save(fig, name, 1200, 420)

    # The grid at its levels, on the four-score pool and on the big pool.
    grid = BlockGridView("GPU block pool · four-score")
    grid.set_decode(decode)
    snap, _ = at("four-score", 5)
    grid.set_snapshot(snap)
    save(grid, "grid_four_score_open", 900, 560)
    for mode in ("owner", "ref count", "age"):
        grid.set_mode(mode)
        save(grid, f"grid_four_score_{mode.replace(' ', '_')}", 900, 560)
    grid.set_mode("state")
    big = BlockGridView("GPU block pool · 65,536 blocks")
    big.set_snapshot(data["big"])
    save(big, "grid_big_open", 1000, 620)
    for px, c in ((2, None), (8, None), (48, QPointF(8, 3)), (160, QPointF(3, 1.5))):
        big.zoom_to(px, c)
        save(big, f"grid_big_{px}px", 1000, 620)
    big.set_mode("owner")
    big.fit_used()
    save(big, "grid_big_owner", 1000, 620)

    leg = LegendView()
    leg.set_snapshot(data["big"])
    leg.set_mode("age")
    save(leg, "legend_age", 220, 260)

    wel = WelcomeView()
    save(wel, "welcome", 900, 600)
    notes = ScenarioNotesPanel()
    sc = load_scenario("four-score")
    notes.set_scenario(sc.watch, sc.notes, sc.title)
    notes.set_step(3)
    save(notes, "scenario_notes", 320, 420)

    log = EventLogView(decode=decode)
    hist = RunHistory()
    for step, snap, events in data["four-score"]:
        log.append(step, events)
        hist.record(snap, 0.05)
    log.set_max_step(3)
    save(log, "event_log_up_to_step_3", 640, 260)
    plots = PlotsPanel()
    plots.update_from(hist)
    plots.set_cursor(3)
    save(plots, "plots_cursor_step_3", 560, 420)
    dlg = InjectDialog(None, None, has_tokenizer=False, vocab_size=256)
    dlg.prompt.setPlainText("1, 5, 9")
    save(dlg, "inject_no_tokenizer", 600, 420)

    # A 1280x720 window's share of each view: the grid in the centre, the figure under it, notes beside.
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QSplitter

    snap, ev = at("four-score", 3)
    split = QSplitter(Qt.Orientation.Horizontal)
    left = QSplitter(Qt.Orientation.Vertical)
    g = BlockGridView("GPU block pool · SmolLM2 · 32 blocks × 4 tokens")
    g.set_decode(decode)
    g.set_snapshot(snap)
    g.set_highlight(list(snap.block_tables["0"]))
    f = FigureView()
    f.set_decode(decode)
    f.set_snapshot(snap)
    f.set_events(ev)
    f.set_requests(["0", "1"])
    left.addWidget(g)
    left.addWidget(f)
    right = QSplitter(Qt.Orientation.Vertical)
    req = RequestPanel()
    req.set_snapshot(snap)
    n2 = ScenarioNotesPanel()
    n2.set_scenario(sc.watch, sc.notes, sc.title)
    n2.set_step(3)
    right.addWidget(n2)
    right.addWidget(req)
    split.addWidget(left)
    split.addWidget(right)
    split.setSizes([930, 350])
    save(split, "window_1280x720_four_score_step3", 1280, 720)

    ban = Banner()
    ban.show_message("audit: 3 block(s) with wrong ref counts (red in the grid)", "audit")
    save(ban, "banner", 900, 40)


if __name__ == "__main__":
    main()
