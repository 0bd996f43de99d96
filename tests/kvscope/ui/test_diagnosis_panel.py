"""The Why? tab's block story in its dock's scroll area: the table takes the height left and scrolls, so the story's
last row (the suspect) is on screen, not below the dock's edge."""

from __future__ import annotations

from PySide6.QtWidgets import QScrollArea

from engine.inspect.block_story import StoryLine
from kvscope.ui.views.diagnosis_panel import DiagnosisPanel

LONG = "request 3 ended at step 11 (aborted) but never released this block: the free after it is missing"


def story(n: int) -> list[StoryLine]:
    lines = [StoryLine(step=i, kind="stored", text=f"event {i} of block 9", holders=("3",)) for i in range(n - 1)]
    return [*lines, StoryLine(step=n, kind="suspect", text=LONG, holders=("3",))]


def test_the_suspect_row_is_on_screen_in_a_short_dock(qtbot):
    panel = DiagnosisPanel()
    area = QScrollArea()  # as main_window.py puts the panel in its dock
    area.setWidgetResizable(True)
    area.setWidget(panel)
    qtbot.addWidget(area)
    area.resize(930, 220)  # the Why? dock at 1280x720
    area.show()
    qtbot.waitExposed(area)
    panel.show_story(9, story(12), (0, 14))
    qtbot.wait(50)
    assert area.verticalScrollBar().maximum() == 0  # the dock does not scroll: the table does
    last = panel.table.visualRect(panel.table.model().index(11, 0))
    viewport = panel.table.viewport().rect()
    assert viewport.contains(last), (last, viewport)  # the suspect row whole in the table's view
    assert panel.table.mapTo(area.viewport(), last.bottomLeft()).y() <= area.viewport().height()
