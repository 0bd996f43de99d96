"""The child process of ``tests/real_window.py``: kvscope's window, started through kvscope's own entry point
(``kvscope.cli.main``) in this process, and a test's questions about it answered on the GUI thread.

Nothing here imports Qt before kvscope does (kvscope starts its engine process before it imports Qt, and a start-up
time measured here must be kvscope's): the driver begins listening when the first ``MainWindow`` is built.

    python tests/window_driver.py --reports DIR [--started T] -- KVSCOPE_ARGS...

One JSON command a line on stdin, one answer a file ``DIR/<id>.json`` (written whole, then renamed):

- ``{"do": "window"}``: the X window id of the top-level window (``x_window``), for xdotool;
- ``{"do": "wait", "for": "loaded" | "step" | "presenting" | "scenario" | "idle", ...}``: answered once the window
  has loaded its source and drawn its first step / drawn step ``step`` / presents (``value``) / loaded
  ``scenario`` / drawn no new step for a second; with ``"measure": true`` the answer holds ``measure``'s report
  of the screen then (a step and its check in one round trip);
- ``{"do": "measure"}``: what is on screen, widget by widget (``measure``);
- ``{"do": "read"}``: the words a person reads in the main window's panels: the legend's rows, the status bar, the
  requests table's cells (and the state column's tooltips), the block table, the figure's text (``read``);
- ``{"do": "grab", "path": P}``: the screen as X shows it (the root window, not Qt's own render) saved to P;
- ``{"do": "quit"}``: close the windows (kvscope exits as it does when a user closes them).

``started`` (the test's clock when it started this process) lets the driver say when things happened, in every
answer: ``exposed_s`` (the window first on screen), ``ready_s`` (on screen with its source loaded and its first step
drawn) and ``at_s`` (the answer itself), each from ``started``.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == ROOT / "tests":  # run as a script: tests/kvscope is not kvscope
    sys.path[0] = str(ROOT)
POLL_MS = 20
HOOKED = "kvscope.ui.main_window"  # the driver starts when the first MainWindow is built


def qt():
    """Qt's classes, imported when kvscope has imported them."""
    from PySide6 import QtCore, QtGui, QtWidgets

    return QtCore, QtGui, QtWidgets


class Driver:
    def __init__(self, reports: Path, started: float) -> None:
        self.reports, self.started = reports, started
        self.ready_at: float | None = None
        self.exposed_at: float | None = None  # the window on screen (its source perhaps still loading)
        self.waits: list[tuple[dict, float]] = []
        self._buf = b""
        core, _gui, _widgets = qt()
        os.set_blocking(0, False)
        self.notifier = core.QSocketNotifier(0, core.QSocketNotifier.Type.Read)
        self.notifier.activated.connect(self._read)
        self.timer = core.QTimer()
        self.timer.timeout.connect(self._poll)
        self.timer.start(POLL_MS)

    # -- the window ----------------------------------------------------------------------------------
    def window(self):
        """The visible main window (kept between polls: Qt's list of top-level widgets costs half a millisecond)."""
        w = qt()[2]
        win = getattr(self, "_window", None)
        if win is not None and win.isVisible():
            return win
        wins = [x for x in w.QApplication.topLevelWidgets() if isinstance(x, w.QMainWindow) and x.isVisible()]
        self._window = wins[0] if wins else None
        return self._window

    def loaded(self) -> bool:
        win = self.window()
        handle = win.windowHandle() if win is not None else None
        info = getattr(win, "info", None)
        latest = getattr(win, "latest", None)
        return bool(handle and handle.isExposed() and info is not None and latest is not None)

    # -- commands -----------------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            chunk = os.read(0, 65536)
        except BlockingIOError:
            return
        if not chunk:  # the test went away: close, as a user would
            self.notifier.setEnabled(False)
            self.quit()
            return
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if line.strip():
                self.handle(json.loads(line))

    def handle(self, cmd: dict) -> None:
        try:
            do = cmd["do"]
            if do == "quit":
                self.quit()
            elif do == "window":
                win = self.window()
                self.answer(cmd, {"x_window": int(win.winId()) if win is not None else 0})
            elif do == "wait":
                self.waits.append((cmd, time.monotonic() + float(cmd.get("timeout", 120))))
                self._poll()
            elif do == "grab":
                win = self.window()
                win.flush()
                qt()[2].QApplication.processEvents()
                ok = qt()[1].QGuiApplication.primaryScreen().grabWindow(0).save(str(cmd["path"]))
                self.answer(cmd, {"saved": bool(ok), "size": [win.width(), win.height()]})
            elif do in ("measure", "read"):
                win = self.window()
                win.flush()
                qt()[2].QApplication.processEvents()
                # a record that came in while those events ran is the newest now: drawn before it is read, so the
                # panels and the snapshot they are read against are one step's (a probed vLLM steps on meanwhile)
                win.flush()
                self.answer(cmd, measure(win) if do == "measure" else read(win))
            else:
                self.answer(cmd, {"error": f"unknown command {do!r}"})
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.answer(cmd, {"error": f"{type(e).__name__}: {e}"})

    def met(self, cmd: dict) -> bool:
        win = self.window()
        if not self.loaded():
            return False
        what = cmd["for"]
        if what == "loaded":
            return True
        if what == "step":  # arrived (the answer draws it: no need to wait for the window's redraw timer)
            return win.latest.step >= int(cmd["step"])
        if what == "presenting":
            return win.presenting == bool(cmd.get("value", True))
        if what == "idle":  # nothing new for a second: a run has stopped where it was told to
            if win.latest.step != getattr(self, "_idle_step", None):
                self._idle_step, self._idle_since = win.latest.step, time.monotonic()
            return time.monotonic() - self._idle_since > 1.0
        if what == "scenario":
            return win.info.scenario_name == cmd["scenario"] and win.latest.snapshot.step == 0 and not win._dirty
        raise ValueError(f"unknown wait {what!r}")

    def _poll(self) -> None:
        if not self.waits and self.ready_at is not None:  # nothing asked, nothing left to time
            return
        if self.exposed_at is None:
            win = self.window()
            handle = win.windowHandle() if win is not None else None
            if handle is not None and handle.isExposed():
                self.exposed_at = time.time()
        if self.ready_at is None and self.loaded():
            self.ready_at = time.time()
        for cmd, end in list(self.waits):
            try:
                if self.met(cmd):
                    self.waits.remove((cmd, end))
                    win = self.window()
                    win.flush()
                    qt()[2].QApplication.processEvents()
                    # "measure": what is on screen then, in the same answer (one round trip a step)
                    self.answer(
                        cmd, {"step": win.latest.step, **({"measure": measure(win)} if cmd.get("measure") else {})}
                    )
                elif time.monotonic() > end:
                    self.waits.remove((cmd, end))
                    self.answer(cmd, {"error": f"timeout waiting for {cmd}"})
            except Exception as e:  # noqa: BLE001
                self.waits.remove((cmd, end))
                self.answer(cmd, {"error": f"{type(e).__name__}: {e}"})

    def answer(self, cmd: dict, body: dict) -> None:
        body = {
            **body,
            "ready_s": None if self.ready_at is None else self.ready_at - self.started,
            "exposed_s": None if self.exposed_at is None else self.exposed_at - self.started,
            "at_s": time.time() - self.started,  # when this answer was written
        }
        tmp = self.reports / f".{cmd.get('id', 0)}.tmp"
        tmp.write_text(json.dumps(body))
        tmp.rename(self.reports / f"{cmd.get('id', 0)}.json")

    def quit(self) -> None:
        for w in qt()[2].QApplication.topLevelWidgets():
            if w.isVisible():
                w.close()


# -- measuring what is on screen ---------------------------------------------------------------------------------
def shown(w) -> bool:
    """Visible, and some of it on screen (not hidden behind a parent's edge)."""
    return w.isVisible() and not w.visibleRegion().isEmpty()


def plain(text: str) -> str:
    if "<" in text and ">" in text:
        doc = qt()[1].QTextDocument()
        doc.setHtml(text)
        return doc.toPlainText()
    return text


def text_px(w) -> float:
    """The pixel size a widget's text is drawn at (rich text's own sizes counted: <small>, font-size)."""
    px = qt()[1].QFontInfo(w.font()).pixelSize()
    text = w.text() if hasattr(w, "text") and callable(w.text) else ""
    sizes = [px]
    if "<small" in text:
        sizes.append(px * 0.8)
    for m in re.finditer(r"font-size:\s*([\d.]+)(px|pt)", text):
        sizes.append(float(m[1]) * (4 / 3 if m[2] == "pt" else 1))
    return min(sizes)


def scrolled(w) -> bool:
    """Inside a scroll area that scrolls (its scroll bar shows): the rest of the text is a scroll away, not cut.
    (Presentation forbids scroll bars: the test finds them in ``scroll_bars``.)"""
    q = qt()[2]
    p = w.parentWidget()
    while p is not None:
        if isinstance(p, q.QAbstractScrollArea):
            bars = (p.verticalScrollBar(), p.horizontalScrollBar())
            return any(b.isVisible() and b.maximum() > b.minimum() for b in bars)
        p = p.parentWidget()
    return False


def cut(w) -> str | None:
    """Why a widget's text is not shown whole (None: it is): shorter than its text needs, or cut by its parent
    (other than by a scroll area that scrolls to the rest)."""
    full = w.visibleRegion().boundingRect()
    if (full.width() < w.width() - 1 or full.height() < w.height() - 1) and not scrolled(w):
        return f"cut by its parent: {full.width()}x{full.height()} of {w.width()}x{w.height()}"
    _core, _gui, q = qt()
    fm = w.fontMetrics()
    if isinstance(w, q.QLabel):
        text = plain(w.text())
        if not text.strip() or w.pixmap() is not None and not w.pixmap().isNull():
            return None
        if w.wordWrap():
            need = w.heightForWidth(w.width())
            return f"needs {need} px high, has {w.height()}" if need > w.height() + 1 else None
        lines = text.split("\n")
        widest = max(fm.horizontalAdvance(line) for line in lines)
        room = w.contentsRect().width()
        if widest > room + 1:
            return f"needs {widest} px wide, has {room}"
        if len(lines) * fm.lineSpacing() > w.contentsRect().height() + 2:
            return f"needs {len(lines)} lines, has {w.contentsRect().height()} px"
        return None
    if isinstance(w, q.QAbstractButton):
        text = w.text().replace("&", "")
        need = fm.horizontalAdvance(text) + (w.iconSize().width() + 4 if not w.icon().isNull() else 0)
        return f"needs {need} px wide, has {w.width()}" if text and need > w.width() else None
    if isinstance(w, q.QComboBox):
        need = fm.horizontalAdvance(w.currentText())
        room = w.width() - 24  # the arrow
        return f"needs {need} px wide, has {room}" if need > room else None
    if isinstance(w, q.QTabBar):
        for i in range(w.count()):
            need = fm.horizontalAdvance(w.tabText(i).replace("&", ""))
            if need > w.tabRect(i).width():
                return f"tab {w.tabText(i)!r} needs {need} px, has {w.tabRect(i).width()}"
    return None


def name_of(w) -> str:
    parts = []
    while w is not None and len(parts) < 4:
        parts.append(w.objectName() or type(w).__name__)
        w = w.parentWidget()
    return "/".join(reversed(parts))


def measure(win) -> dict:
    """Every visible text of the window (its pixel size, and why it is cut if it is), the scroll bars showing, and
    for kvscope's main window what it shows: the step, the lesson's subject, what is selected, the grid's cells on
    screen, the figure's text sizes."""
    _core, gui, q = qt()
    texts, clipped = [], []
    for kind in (q.QLabel, q.QAbstractButton, q.QComboBox, q.QTabBar):
        for w in win.findChildren(kind):
            if not shown(w):
                continue
            text = plain(w.text()) if hasattr(w, "text") else ""
            if isinstance(w, q.QTabBar):
                text = " | ".join(w.tabText(i) for i in range(w.count()))
            if isinstance(w, q.QComboBox):
                text = w.currentText()
            if not text.strip():
                continue
            texts.append({"widget": name_of(w), "text": text[:60], "px": text_px(w)})
            why = cut(w)
            if why:
                clipped.append({"widget": name_of(w), "text": text[:60], "why": why})
    bars = []
    for area in win.findChildren(q.QAbstractScrollArea):
        if not shown(area):
            continue
        for bar, which in ((area.horizontalScrollBar(), "horizontal"), (area.verticalScrollBar(), "vertical")):
            if bar.isVisible() and bar.maximum() > bar.minimum():
                bars.append({"area": name_of(area), "bar": which})
    report = {
        "size": [win.width(), win.height()],
        "texts": texts,
        "clipped": clipped,
        "scroll_bars": bars,
        "min_text_px": min((t["px"] for t in texts), default=0),
    }
    if hasattr(win, "figure") and hasattr(win, "grid"):
        report.update(main_window(win))
    return report


def main_window(win) -> dict:
    from kvscope.scenario import subject_at

    snap = win.latest.snapshot if win.latest is not None else None
    step = snap.step if snap is not None else None
    subject = subject_at(win.subjects, step)
    grids = {}
    for name, g in (("gpu", win.grid), ("cpu", win.cpu_grid)):
        if not shown(g) or g.grid is None:
            continue
        rows, cols = g.grid.shape
        r0, r1, c0, c1 = g.visible_cells()
        plot = g.plot
        grids[name] = {
            "cells": g.num_cells(),
            "all_on_screen": (r0, c0) == (0, 0)
            and (r1, c1) == (rows, cols)
            and plot.visibleRegion().boundingRect().size() == plot.size(),
            "px_per_cell": g.pixels_per_cell(),
            "label_px": g.layer.min_px,
            "highlight": sorted(int(b) for b in g.highlight),
        }
    fig = win.figure
    report = {
        "step": step,
        "scenario": win.info.scenario_name if win.info is not None else None,
        "presenting": win.presenting,
        "lesson_view": win.lesson_view(),
        "subject": None if subject is None else {"requests": list(subject.requests), "blocks": list(subject.blocks)},
        "focus": {"requests": list(win.focus.requests), "blocks": list(win.focus.blocks), "rule": win.focus.rule},
        "selected": win.requests.selected_ids(),
        "grids": grids,
        "figure": {
            "shown": shown(fig.view),
            "requests": list(fig.request_ids),
            "blocks": list(fig.focus_blocks),
            "min_text_px": fig.min_text_px() if shown(fig.view) else None,
            "whole": fig.lesson_in_view() if shown(fig.view) else None,
            "layout": repr(fig.layout_used),
        },
        "welcome_buttons": {
            name: b.visibleRegion().boundingRect().size() == b.size() for name, b in win.welcome.buttons.items()
        }
        if shown(win.welcome)
        else {},
    }
    if win.presenting:
        page = win.present_page
        report["note_px"] = qt()[1].QFontInfo(page.note.font()).pixelSize() if shown(page.note) else None
        report["page_clipped"] = page.clipped()
    table = win.requests.table
    if shown(table) and win.requests.model.rows:
        h = table.rowHeight(0) or 1
        report["request_rows_shown"] = min(len(win.requests.model.rows), table.viewport().height() // h)
    return report


def read(win) -> dict:
    """What the main window's panels say, as the widgets show it (their texts, not the models behind them): the
    legend's rows (name: count), the status bar's line, the requests table (header, each row's cells, the state
    column's tooltip), the selected request's block table, the paper's figure (every text it drew), and the
    statuses of the requests the window follows (from the snapshot it drew)."""
    core, _gui, q = qt()
    display, tip = core.Qt.ItemDataRole.DisplayRole, core.Qt.ItemDataRole.ToolTipRole
    legend = win.grid.legend
    rows = {}
    for _sw, name, count, _meaning in legend._widgets:  # the rows' labels as drawn
        if shown(name):
            rows[name.text()] = count.text()
    model = win.requests.model
    header = [str(model.headerData(c, core.Qt.Orientation.Horizontal)) for c in range(model.columnCount())]
    cells = [
        [str(model.data(model.index(r, c), display)) for c in range(model.columnCount())]
        for r in range(model.rowCount())
    ]
    state = header.index("state")
    tips = [str(model.data(model.index(r, state), tip)) for r in range(model.rowCount())]
    bt = win.requests.block_table
    block_table = [
        [bt.item(r, c).text() if bt.item(r, c) is not None else "" for c in range(bt.columnCount())]
        for r in range(bt.rowCount())
    ]
    fig = win.figure
    fig._ensure()
    figure = [it.text() for it in fig.scene.items() if isinstance(it, q.QGraphicsSimpleTextItem)]
    snap = win.latest.snapshot if win.latest is not None else None
    focus_status = {}
    for rid in win.focus.requests:
        r = snap.request(rid) if snap is not None else None
        focus_status[rid] = r.status if r is not None else None
    return {
        "step": snap.step if snap is not None else None,
        "legend_title": legend.title.text(),
        "legend": rows,
        "status": win.status_label.text(),
        "status_tip": win.status_label.toolTip(),
        "requests_header": header,
        "requests": cells,
        "state_tips": tips,
        "block_table": block_table,
        "welcome_shown": shown(win.welcome),
        "figure_shown": shown(fig.view),
        "figure": figure,
        "figure_caption": plain(fig.caption.text()),
        "focus": {"requests": list(win.focus.requests), "rule": win.focus.rule, "status": focus_status},
        "selected": win.requests.selected_ids(),
        "running": [r.request_id for r in snap.requests if r.status == "RUNNING"] if snap is not None else [],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reports", required=True, type=Path)
    ap.add_argument("--started", type=float, default=None)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    started = a.started if a.started is not None else time.time()
    drivers: list[Driver] = []
    sys.meta_path.insert(0, _Hook(lambda: drivers or drivers.append(Driver(a.reports, started))))
    from kvscope.cli import main as kvscope_main

    return kvscope_main(args)


class _Hook(importlib.abc.MetaPathFinder):
    """Once ``kvscope.ui.main_window`` is imported, wrap ``MainWindow.__init__`` so that the driver starts when the
    first window is built (the QApplication exists then, on this thread)."""

    def __init__(self, on_window) -> None:
        self.on_window = on_window

    def find_spec(self, name, path, target=None):
        if name != HOOKED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        on_window = self.on_window

        def exec_module(module) -> None:
            run(module)
            init = module.MainWindow.__init__

            def wrapped(win, *args, **kwargs) -> None:
                init(win, *args, **kwargs)
                on_window()

            module.MainWindow.__init__ = wrapped

        spec.loader.exec_module = exec_module
        return spec


if __name__ == "__main__":
    sys.exit(main())
