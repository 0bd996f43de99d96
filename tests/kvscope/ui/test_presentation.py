"""A projector at 1280x720 with 1.5x text (issue 34): presentation mode keeps each textbook lesson whole, tabs
read whole, no legend lies over a bar, and in presentation nothing is drawn smaller than 12 px."""

from __future__ import annotations

import copy
import json
import re

import pytest
from PySide6.QtGui import QFontInfo
from PySide6.QtWidgets import QAbstractButton, QComboBox, QLabel, QTabBar

from engine import EngineConfig, LLMEngine
from kvscope.scenario import ScenarioRunner, load_scenario
from kvscope.sources.live import LiveSource
from kvscope.ui.main_window import PRESENT_MIN_TEXT_PX
from kvscope.ui.style import min_text_px, text_scale
from kvscope.ui.views.figure_view import present_text_px

# the textbook's lessons at the step their note names, with the requests the lesson's note points at (no selection
# made by the test: the window follows the lesson's subject)
LESSONS = [
    ("four-score", 1, ["0"]),  # figure 4: one request prefilled
    ("four-score", 3, ["0", "1"]),  # figure 5: its table gains a block, after B's
    ("four-score", 7, ["0", "1"]),  # figure 5: two requests interleaved in one pool
    ("parallel-sampling", 2, ["0", "0#1"]),  # figure 6: two samples sharing blocks, the copy-on-write step
    ("parallel-sampling", 4, ["0", "0#1"]),  # figure 6: the tables diverged, full blocks still shared
]


@pytest.fixture
def window(open_window, smollm2):
    model, tok, _src = smollm2  # the lessons' prompts are text: their blocks as the classroom sees them
    tok = copy.deepcopy(tok)  # this window's engine thread's own (a Rust tokenizer is not shared across threads)

    def source(name: str) -> LiveSource:
        sc = load_scenario(name) if name else None
        config = EngineConfig(**sc.config) if sc else EngineConfig(block_size=4, num_gpu_blocks=32)
        engine = LLMEngine.from_hf_model(model, tok, config, name="SmolLM2")
        return LiveSource(engine, ScenarioRunner(sc) if sc else None)

    win = open_window(source, loaded="info", timeout_ms=120_000, size=(1280, 720))
    yield win
    win.set_presentation(False)
    win.shutdown()


def lesson(qtbot, win, name: str, steps: int) -> None:
    win.load_scenario(name)
    qtbot.waitUntil(lambda: win.info is not None and win.info.scenario_name == name, timeout=120_000)
    win.step(steps)
    qtbot.waitUntil(lambda: win.latest is not None and win.latest.step >= steps, timeout=120_000)
    win.flush()
    qtbot.wait(150)  # the page settles at its sizes, the figure lays itself out for them
    win.flush()


def visible_texts(win):
    """(widget, pixel size) of every visible widget that shows text."""
    for w in (w for kind in (QLabel, QAbstractButton, QComboBox, QTabBar) for w in win.findChildren(kind)):
        if w.isVisibleTo(win) and w.isVisible():
            if isinstance(w, QLabel) and not w.text().strip():
                continue
            yield w, QFontInfo(w.font()).pixelSize()


@pytest.mark.parametrize("name,steps,select", LESSONS, ids=[f"{n}@{s}:{'+'.join(r)}" for n, s, r in LESSONS])
def test_each_lesson_is_whole_at_18_px_and_follows_its_subject(qtbot, window, name, steps, select):
    win = window
    win.set_presentation(True)
    lesson(qtbot, win, name, steps)
    assert win.presenting and min_text_px() == PRESENT_MIN_TEXT_PX and text_scale() >= 1.5
    assert win.central.currentWidget() is win.present_page and not win.menuBar().isVisible()
    assert win.figure.request_ids == select and win.requests.selected_ids() == select  # the lesson's, not a click
    assert win.focus.rule == "lesson" and "lesson's subject" in win.figure.why
    assert win.figure.lesson_in_view(), f"{name} at step {steps}: the lesson's rows are cut {win.figure.last_lesson}"
    assert win.figure.min_text_px() >= present_text_px() >= 18
    small = [
        (type(w).__name__, getattr(w, "text", lambda: "")()[:30], px)
        for w, px in visible_texts(win)
        if px < PRESENT_MIN_TEXT_PX
    ]
    assert not small, small
    assert not win.present_page.clipped()
    layer = win.grid.layer
    assert layer.min_px == 0 or layer.min_px >= PRESENT_MIN_TEXT_PX  # the grid leaves out labels it cannot show
    r0, r1, c0, c1 = win.grid.visible_cells()
    assert (r0, c0, r1, c1) == (0, 0, *win.grid.grid.shape)  # the whole pool
    for name_ in ("requests", "events", "plots", "fragmentation", "diagnosis", "miss", "scenario"):
        assert not win.docks[name_].isVisible()  # the other panels stepped aside


def test_a_lesson_on_another_panel_presents_that_panel(qtbot, window):
    win = window
    win.set_presentation(True)
    lesson(qtbot, win, "fragmentation", 10)
    assert win.lesson_view() == "fragmentation" and win.present_page.lesson.widget() is win.fragmentation
    assert not win.figure.isVisible() and not win.docks["requests"].isVisible()
    frag = win.fragmentation
    assert 0 < frag.canvas.bars_bottom <= frag.canvas.height()


def test_leaving_presentation_restores_the_panels_and_the_text_size(qtbot, window):
    win = window
    win.set_text_scale(1.0)
    before = {n: d.isVisible() for n, d in win.docks.items()}
    win.act_present.trigger()
    assert win.presenting and text_scale() == 1.5 and win.figure.parentWidget() is not win.docks["figure"]
    win.act_present.trigger()
    qtbot.wait(50)
    assert not win.presenting and text_scale() == 1.0 and min_text_px() is None
    assert {n: d.isVisible() for n, d in win.docks.items()} == before
    assert win.docks["figure"].widget() is win.figure and win.menuBar().isVisible()
    assert win.central.currentIndex() == 0 and win.grid.parentWidget() is win.pool
    assert float(win.settings.value("text_scale")) == 1.0  # presentation's scale is not kept as the user's


def test_at_1_5x_text_the_tabs_read_whole_and_no_legend_lies_over_a_bar(qtbot, window):
    win = window
    win.set_text_scale(1.5)
    lesson(qtbot, win, "fragmentation", 10)
    bars = [b for b in win.findChildren(QTabBar) if b.isVisible() and b.count()]
    assert bars
    for bar in bars:
        for i in range(bar.count()):
            text = bar.tabText(i)
            need = bar.fontMetrics().horizontalAdvance(text)
            assert need <= bar.tabRect(i).width(), f"tab {text!r} is cut ({need} px in {bar.tabRect(i).width()})"
    win.show_view("fragmentation")
    qtbot.wait(100)
    frag = win.fragmentation
    assert frag.canvas.bars_bottom > 0, "the fragmentation figure drew its bars"
    assert frag.canvas.bars_bottom <= frag.canvas.height()
    canvas, legend = frag.canvas.geometry(), frag.legend.geometry()
    assert not canvas.intersects(legend), (canvas, legend)


def test_selected_blocks_are_a_spotlight_not_a_pale_wash_and_a_state_is_said_in_words(qtbot, window):
    """Pale green is the fragmentation figure's "reserved, empty": a selection dims the other blocks instead of
    whitening its own; and the request table says a state in words (issue 40), vLLM's own in the tooltip."""
    from PySide6.QtCore import Qt

    from kvscope.ui.status_words import WIDEST

    win = window
    win.resize(1280, 720)
    lesson(qtbot, win, "four-score", 9)
    mask = win.grid.overlay.image
    if mask is not None:  # small cells: the overlay is drawn
        cols = win.grid.grid.shape[1]
        for b in win.grid.highlight:
            assert mask[b // cols, b % cols, 3] == 0
        others = [b for b in range(win.latest.snapshot.num_blocks) if b not in set(win.grid.highlight)]
        assert all(mask[b // cols, b % cols, 3] > 0 for b in others)
    model = win.requests.model
    col = model.HEADERS.index("state")
    index = model.index(model.row_of("0"), col)
    assert index.data() == "finished: max tokens"  # not finished_length
    assert "FINISHED_LENGTH_CAPPED" in index.data(Qt.ItemDataRole.ToolTipRole)  # vLLM's own word
    fm = win.requests.table.fontMetrics()
    assert win.requests.table.columnWidth(col) >= fm.horizontalAdvance(WIDEST)


# -- the rules under the window: what it points at, and the words it uses ------------------------------------------


def test_the_focus_rule_prefers_a_pin_then_the_lesson_then_the_audit_then_the_newest_running():
    """Issue 40.2: the figure follows a request by default, for every source; the user can pin another."""
    from types import SimpleNamespace as NS

    from engine.inspect.audit import AuditProblem, AuditReport
    from kvscope.scenario import Subject
    from kvscope.ui import focus

    def req(rid, index, status="RUNNING"):
        return NS(request_id=rid, index=index, status=status)

    reqs = [req("a", 0), req("b", 1), req("c", 2, "WAITING")]
    snap = NS(requests=reqs, request=lambda rid: next((r for r in reqs if r.request_id == rid), None))
    audit = AuditReport((AuditProblem(7, "leaked", 0, 1, "a"),))
    lesson = Subject(3, ("b",), (7,))
    assert focus.choose(snap, audit, lesson, pinned=("a",)) == focus.Focus(("a",), (), focus.PINNED)
    f = focus.choose(snap, audit, lesson)
    assert (f.requests, f.blocks, f.rule, f.step) == (("b",), (7,), focus.LESSON, 3) and "step 3" in f.why
    f = focus.choose(snap, audit)
    assert (f.requests, f.blocks, f.rule) == (("a",), (7,), focus.AUDIT) and "audit" in f.why
    f = focus.choose(snap)
    assert (f.requests, f.rule) == (("b",), focus.NEWEST) and "newest running" in f.why  # not the waiting one
    done = [req("a", 0, "FINISHED_LENGTH")]
    ended = NS(requests=done, request=lambda rid: done[0] if rid == "a" else None)
    assert focus.choose(ended, previous=f).rule == focus.NONE  # "b" is gone
    assert focus.choose(ended, previous=focus.Focus(("a",), (), focus.NEWEST)).rule == focus.LAST


def test_a_lessons_subject_holds_until_the_next_and_bad_ones_are_one_line(tmp_path):
    from kvscope.scenario import Subject, subject_at

    subjects = load_scenario("leak-hunt").subjects
    assert subject_at(subjects, 0) is None
    assert subject_at(subjects, 9) == Subject(7, ("1",), (0, 1, 2, 5, 6, 7))  # held from step 7 to step 10
    assert subject_at(subjects, 11).blocks == (9, 10, 11)
    for bad, says in (
        ({"at": 1, "text": "x", "requests": ["0", "1", "2"]}, "at most 2 request ids"),
        ({"at": 1, "text": "x", "blocks": [99]}, "block ids in 0..31"),
        ({"at": 1, "text": "x", "request": ["0"]}, "unknown key(s) ['request']"),
    ):
        p = tmp_path / "s.json"
        p.write_text(json.dumps({"config": {"num_gpu_blocks": 32}, "notes": [bad], "requests": [{"prompt": "hi"}]}))
        with pytest.raises(ValueError, match=re.escape(says)):
            load_scenario(str(p))


def test_every_state_is_said_in_words_with_vllms_own_word_in_the_tooltip():
    """Issue 40.3: no raw spelling (finished_length) where a person reads."""
    from engine.core.request import RequestStatus
    from kvscope.sources.probe_mirror import STATUS
    from kvscope.ui.status_words import status_tip, status_words

    for status in [s.name for s in RequestStatus] + list(STATUS) + list(STATUS.values()):
        words = status_words(status)
        assert "_" not in words, (status, words)
        assert "vLLM" in status_tip(status)
    assert status_words("FINISHED_LENGTH") == "finished: max tokens"
    assert "FINISHED_LENGTH_CAPPED" in status_tip("FINISHED_LENGTH") and '"length"' in status_tip("FINISHED_LENGTH")
    assert status_words("SWAPPED") == "preempted: swapped out" and status_words("PREEMPTED") == "preempted: recompute"


def test_the_audit_banner_names_every_flagged_block_grouped_the_lessons_first():
    """leak-hunt at step 11: the banner listed blocks 0-2 (its first three problems) while the note spoke of 9-11."""
    from engine.inspect.audit import AuditProblem, AuditReport
    from kvscope.ui.views.banner import audit_banner, block_ranges

    problems = [AuditProblem(b, "leaked", 2, 4, "3") for b in (0, 1, 2)]
    problems += [AuditProblem(b, "leaked", 0, 1, "1") for b in (5, 6, 7)]
    problems += [AuditProblem(b, "leaked", 0, 1, "3") for b in (9, 10, 11)]
    text = audit_banner(AuditReport(tuple(problems)), first=(9, 10, 11))
    assert text.startswith("audit: 9 blocks leaked")
    assert text.index("blocks 9-11") < text.index("blocks 0-2") and "blocks 5-7" in text
    assert "held by no table, last held by request 3" in text and "2 table(s) hold it" in text
    assert block_ranges([0, 1, 2, 5, 6, 9]) == "0-2, 5, 6, 9"


def test_view_chooses_the_presented_panel_and_a_click_pins_until_esc(qtbot, window):
    """``--view diagnosis`` with ``--present`` presents the Why? panel (it was ignored); a row clicked pins that
    request over the lesson's subject until Esc."""
    win = window
    win.set_presentation(True)
    lesson(qtbot, win, "four-score", 7)
    win.show_view("diagnosis")
    assert win.present_page.lesson is win.diagnosis_panel and win.lesson_view() == "diagnosis"
    win.show_view("figure")
    assert win.present_page.lesson is win.figure
    win.requests.select(["1"])  # as a click on its row
    win.flush()
    assert win.focus.rule == "pinned" and win.figure.request_ids == ["1"] and "your choice" in win.figure.why
    win.step(1)
    qtbot.waitUntil(lambda: win.latest.step >= 8, timeout=120_000)
    win.flush()
    assert win.figure.request_ids == ["1"]  # the pin holds as the lesson steps
    win.unpin()  # Esc
    assert win.focus.rule == "lesson" and win.figure.request_ids == ["0", "1"]


def test_font_scale_applies_to_the_figure_too(qtbot, window):
    """``--font-scale 2`` enlarged everything around the figure and not the figure (issue 42): presenting at 2x,
    the figure's text is 24 px, laid out to fit, not shrunk."""
    win = window
    win.set_text_scale(2.0)
    win.set_presentation(True)
    lesson(qtbot, win, "four-score", 3)
    assert text_scale() == 2.0 and win.figure.min_text_px() >= 24 - 0.01
    assert win.figure.lesson_in_view()
    win.set_presentation(False)
    win.set_text_scale(1.0)
