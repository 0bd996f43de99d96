"""The prefix forest of an attached engine's cache, and a small window around it.

``PrefixForestView`` draws a ``RemoteCacheModel`` (or a ``ForestSnapshot``): one band per
data-parallel rank and medium, each tree growing left to right from a prompt's first block,
nodes coloured by medium, an orphan (a block whose parent is not cached) outlined in red;
hovering a node shows its hash and tokens (as text, given a ``decode``).

For the integrator: ``AttachPanel`` is the whole attach view (what attach cannot show, the
forest, store / evict rates and cache size over polls, counters and unrepaired gaps, the event
log); call ``panel.show_record(record, source.model)`` with each ``AttachRecord``.
``run_attach_window(source, ...)`` runs it as a window (``kvscope --attach``), driving the source through
the ``Source`` interface (``has_work``, ``step``: one poll, ``info``, ``close``), and

    python -m kvscope.ui.views.prefix_forest --attach tcp://HOST:5557 [--replay-endpoint tcp://HOST:5558]
    python -m kvscope.ui.views.prefix_forest --demo --screenshot docs/attach.png

attaches to an engine, or (``--demo``) to a kvscope publishing the shared-system-prompt
requests on the embedded SmolLM2 in the same process.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSlider,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from kvscope.sources.attach_history import AttachHistory
from kvscope.sources.attached import CANNOT_SHOW, AttachRecord
from kvscope.sources.base import StepRecord
from kvscope.sources.remote_cache import DrawNode, ForestSnapshot, RemoteCacheModel, Tier, hash_text
from kvscope.ui.host import HostedWindow
from kvscope.ui.views.event_log import EventLogView

MEDIUM_COLOURS = {"GPU": (52, 168, 83), "CPU": (66, 133, 244), "DISK": (251, 140, 0)}
OTHER_COLOUR = (171, 71, 188)
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class ForestLayout:
    nodes: tuple[DrawNode, ...]
    x: np.ndarray  # depth
    y: np.ndarray  # leaves one apart, parents centred over their children; bands stacked downwards
    edges: np.ndarray  # [2 * E, 2]: parent, child, parent, child, ...
    bands: tuple[tuple[Tier, float, int], ...]  # (tier, top y, nodes drawn)


def layout_forest(snap: ForestSnapshot, band_gap: float = 2.0) -> ForestLayout:
    """Tree layout, no crossings: leaves in depth-first order, each parent at its children's mean."""
    nodes: list[DrawNode] = []
    xs: list[float] = []
    ys: list[float] = []
    edges: list[tuple[float, float]] = []
    bands = []
    top = 0.0
    for tier in sorted(snap.tiers):
        drawn = snap.tiers[tier]
        if not drawn:
            continue
        index = {n.key: i for i, n in enumerate(drawn)}
        kids: list[list[int]] = [[] for _ in drawn]
        roots = []
        for i, n in enumerate(drawn):
            p = index.get(n.parent) if n.parent is not None else None
            (kids[p] if p is not None else roots).append(i)
        y = np.zeros(len(drawn))
        leaf = 0
        stack = list(reversed(roots))
        while stack:  # depth-first, iteratively: prefixes can be thousands of blocks deep
            i = stack.pop()
            if not kids[i]:
                y[i] = leaf
                leaf += 1
            stack.extend(reversed(kids[i]))
        for i in range(len(drawn) - 1, -1, -1):  # breadth-first order reversed: children first
            if kids[i]:
                y[i] = float(np.mean(y[kids[i]]))
        y = -(top + y)
        base = len(nodes)
        nodes.extend(drawn)
        xs.extend(float(n.depth) for n in drawn)
        ys.extend(y.tolist())
        for i, n in enumerate(drawn):
            p = index.get(n.parent) if n.parent is not None else None
            if p is not None:
                edges += [(xs[base + p], ys[base + p]), (xs[base + i], ys[base + i])]
        bands.append((tier, -top, len(drawn)))
        top += leaf + band_gap
    return ForestLayout(tuple(nodes), np.array(xs), np.array(ys), np.array(edges).reshape(-1, 2), tuple(bands))


def captioned(owner: QWidget, plot: pg.PlotWidget, hover_hint: str) -> tuple[QLabel, QLabel]:
    """A forest's plot filling ``owner``, with two lines under it: what it shows (``info``), and what hovering a
    block shows (``hover``, ``hover_hint`` until then)."""
    info = QLabel("no blocks cached yet")
    hover = QLabel(hover_hint)
    hover.setWordWrap(True)
    lay = QVBoxLayout(owner)
    lay.setContentsMargins(0, 0, 0, 0)
    lay.addWidget(plot, 1)
    lay.addWidget(info)
    lay.addWidget(hover)
    return info, hover


class PrefixForestView(QWidget):
    """Draws the forest; ``set_model`` takes a bounded snapshot (``max_nodes``) of a live model."""

    def __init__(self, decode: Decode | None = None, max_nodes: int = 4000) -> None:
        super().__init__()
        self.decode = decode
        self.max_nodes = max_nodes
        self.plot = pg.PlotWidget()
        self.plot.setBackground("w")
        self.plot.hideAxis("left")
        self.plot.setLabel("bottom", "blocks from the start of the prefix")
        self.plot.setMenuEnabled(False)
        self.edges = pg.PlotDataItem([], [], connect="pairs", pen=pg.mkPen((170, 170, 170), width=1))
        self.scatter = pg.ScatterPlotItem(size=9, hoverable=True, tip=self._tip, pxMode=True)
        self.scatter.sigHovered.connect(self._on_hover)
        self.plot.addItem(self.edges)
        self.plot.addItem(self.scatter)
        self.labels: list[pg.TextItem] = []
        self.info, self.hover = captioned(self, self.plot, "hover a block to see its tokens")
        self._layout = layout_forest(ForestSnapshot({}, 0, 0))

    # -- data ------------------------------------------------------------------------------
    def set_model(self, model: RemoteCacheModel) -> None:
        self.set_snapshot(model.snapshot(self.max_nodes))

    def set_snapshot(self, snap: ForestSnapshot) -> None:
        lay = self._layout = layout_forest(snap)
        brushes = [pg.mkBrush(*MEDIUM_COLOURS.get(n.key[1], OTHER_COLOUR)) for n in lay.nodes]
        red, plain = pg.mkPen((229, 57, 53), width=2), pg.mkPen((60, 60, 60), width=0.5)
        pens = [red if n.orphan else plain for n in lay.nodes]
        self.scatter.setData(x=lay.x, y=lay.y, brush=brushes, pen=pens, data=list(range(len(lay.nodes))))
        self.edges.setData(lay.edges[:, 0], lay.edges[:, 1]) if len(lay.edges) else self.edges.setData([], [])
        for t in self.labels:
            self.plot.removeItem(t)
        self.labels = []
        for (rank, medium), top, count in lay.bands:
            t = pg.TextItem(f"dp {rank} · {medium} · {count} blocks", color=(40, 40, 40), anchor=(0, 1))
            t.setPos(-0.5, top + 0.6)
            self.plot.addItem(t)
            self.labels.append(t)
        orphans = sum(n.orphan for n in lay.nodes)
        more = f" (showing {snap.shown} of {snap.total_blocks})" if snap.truncated else ""
        self.info.setText(
            f"{snap.total_blocks} cached blocks in {len(lay.bands)} tier(s){more}; "
            f"{orphans} orphan(s) outlined red: their parent block is not cached"
        )

    # -- queries (tests, hover) -------------------------------------------------------------
    def node_count(self) -> int:
        return len(self._layout.nodes)

    def band_labels(self) -> list[str]:
        return [t.toPlainText() for t in self.labels]

    def node_text(self, i: int) -> str:
        n = self._layout.nodes[i]
        rank, medium, h = n.key
        head = f"block {hash_text(h)[:16]} · dp {rank} · {medium} · depth {n.depth} · {n.num_tokens} tokens"
        if n.orphan:
            head += " · parent not cached"
        if not n.token_ids:
            return head + "\n(no token ids in the event)"
        ids = ", ".join(map(str, n.token_ids[:32])) + (" …" if len(n.token_ids) > 32 else "")
        text = f"{head}\ntokens [{ids}]"
        if self.decode is not None:
            try:
                text += f"\n{self.decode(list(n.token_ids))!r}"
            except Exception:  # noqa: BLE001 - a foreign engine's ids may not fit our tokenizer
                text += "\n(tokens do not decode with this tokenizer)"
        return text

    def _tip(self, x=None, y=None, data=None) -> str:
        return self.node_text(int(data)) if data is not None else ""

    def _on_hover(self, _item, points, _ev) -> None:
        if len(points):
            self.hover.setText(self.node_text(int(points[0].data())))


class AttachPanel(QWidget):
    """Everything attach mode shows; ``show_record`` after each poll."""

    def __init__(self, describe: dict, decode: Decode | None = None, history: int = 5000) -> None:
        super().__init__()
        self.banner = QLabel(describe.get("cannot_show", CANNOT_SHOW))
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet("background:#3b3320; color:#f0d58c; padding:6px; border-radius:4px;")
        self.title = QLabel(f"<b>{describe.get('model_name', 'attached')}</b>")
        self.forest = PrefixForestView(decode)
        self.plots = pg.GraphicsLayoutWidget()
        rates = self.plots.addPlot(row=0, col=0, title="blocks stored / removed per second")
        rates.addLegend(offset=(-5, 5))
        size = self.plots.addPlot(row=0, col=1, title="cache size (blocks)")
        self.curves = {
            "stored": rates.plot([], [], pen=pg.mkPen((52, 168, 83), width=2), name="stored"),
            "removed": rates.plot([], [], pen=pg.mkPen((229, 57, 53), width=2), name="removed"),
            "blocks": size.plot([], [], pen=pg.mkPen((66, 133, 244), width=2)),
        }
        self.series: dict[str, deque] = {k: deque(maxlen=history) for k in ("t", "stored", "removed", "blocks")}
        self.cursors = []  # the timeline's position on each plot
        for plot in (rates, size):
            line = pg.InfiniteLine(angle=90, pen=pg.mkPen((216, 222, 233), width=1, style=Qt.PenStyle.DashLine))
            line.setVisible(False)
            plot.addItem(line)
            self.cursors.append(line)
        self.status = QLabel("waiting for events")
        self.status.setWordWrap(True)
        self.events = EventLogView()
        split = QSplitter()
        split.addWidget(self.forest)
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.plots)
        right.addWidget(self.events)
        split.addWidget(right)
        split.setSizes([900, 500])
        lay = QVBoxLayout(self)
        lay.addWidget(self.title)
        lay.addWidget(self.banner)
        lay.addWidget(split, 1)
        lay.addWidget(self.status)

    def show_record(self, rec: AttachRecord, model: RemoteCacheModel) -> None:
        """A new poll, live: add it to the plots and the event log, then show it."""
        self.add_record(rec)
        self.show_at(rec, model, live=True)

    def add_record(self, rec: AttachRecord) -> None:
        s = self.series
        s["t"].append(rec.t)
        s["stored"].append(rec.rates["stored_per_s"])
        s["removed"].append(rec.rates["removed_per_s"])
        s["blocks"].append(rec.summary.blocks)
        t = list(s["t"])
        for k in ("stored", "removed", "blocks"):
            self.curves[k].setData(t, list(s[k]))
        self.events.append(rec.tick, list(rec.events))

    def show_at(self, rec: AttachRecord, model: RemoteCacheModel, live: bool = True) -> None:
        """The forest and counters at one poll (the live one, or the timeline's)."""
        self.forest.set_model(model)
        for line in self.cursors:
            line.setVisible(not live)
            line.setValue(rec.t)
        self.events.set_max_step(None if live else rec.tick)
        c = rec.counters
        gaps = (
            f" · <span style='color:#c62828'><b>{c['gaps_unrepaired']} unrepaired gap(s), "
            f"{c['batches_missing']} batch(es) missing</b>: the model may miss blocks</span>"
            if c["gaps_unrepaired"]
            else ""
        )
        self.status.setText(
            f"{'' if live else 'looking back: '}poll {rec.tick} · {rec.summary.blocks} blocks, "
            f"{rec.summary.tokens} tokens · "
            f"{c['batches']} batches ({c['batches_replayed']} replayed) · {c['gaps_repaired']} gap(s) repaired · "
            f"skipped {c['malformed_messages']} malformed, {c['unknown_event_kinds']} unknown, "
            f"{c['bad_events']} bad{gaps}"
        )


class AttachWindow(HostedWindow):
    """kvscope's window in attach mode: the forest, rates, counters, event log and a timeline over polls.

    The engine's controls (step, inject, abort, fork, audit, the block grid and tables) do not apply to
    an engine kvscope does not run, so this window has none; its banner says what the events carry.
    """

    def __init__(self, source, decode: Decode | None = None) -> None:
        """``source``: a Source with PREFIX_FOREST (sources.attached); its ``model`` is the live forest."""
        super().__init__()
        self.source = source
        info = source.info
        self.panel = AttachPanel({"model_name": info.model_name, **info.extra}, decode)
        self.history = AttachHistory()
        self.live = True
        self.timeline = QSlider(Qt.Orientation.Horizontal)
        self.timeline.setRange(0, 0)
        self.timeline.valueChanged.connect(self._on_timeline)
        self.timeline_label = QLabel("live")
        self.timeline_label.setMinimumWidth(70)
        live = QPushButton("Live")
        live.clicked.connect(self.follow_live)
        row = QHBoxLayout()
        row.addWidget(QLabel("timeline"))
        row.addWidget(self.timeline, 1)
        row.addWidget(self.timeline_label)
        row.addWidget(live)
        centre = QWidget()
        lay = QVBoxLayout(centre)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.panel, 1)
        lay.addLayout(row)
        self.setCentralWidget(centre)
        self.setWindowTitle(f"kvscope · {info.model_name}")
        self.setMinimumSize(1024, 600)
        self.resize(1500, 900)

    def on_step(self, rec: StepRecord | None, last: bool = False) -> None:
        """A step of the source (``ui.poll_driver``): its poll; None at the source's end."""
        if rec is not None:
            self.on_record(rec.cache, last)

    def on_record(self, rec: AttachRecord, last: bool = False) -> None:
        """A new poll: into the history and the plots; on screen when following live (``last``: the screenshot's)."""
        self.history.record(rec, self.source.model)
        self.panel.add_record(rec)
        ticks = self.history.ticks
        self.timeline.blockSignals(True)
        self.timeline.setRange(0, max(len(ticks) - 1, 0))
        if self.live:
            self.timeline.setValue(len(ticks) - 1)
        self.timeline.blockSignals(False)
        if self.live:
            self.panel.show_at(rec, self.source.model, live=True)

    def _on_timeline(self, pos: int) -> None:
        ticks = self.history.ticks
        if not ticks:
            return
        self.live = pos >= len(ticks) - 1
        tick = ticks[min(pos, len(ticks) - 1)]
        rec = self.history.record_at(tick)
        model = self.source.model if self.live else self.history.at(tick)
        self.timeline_label.setText("live" if self.live else f"poll {tick}")
        if rec is not None and model is not None:
            self.panel.show_at(rec, model, live=self.live)

    def prepare_screenshot(self) -> None:
        """Offscreen there is no mouse: show what hovering the deepest block would (for a screenshot)."""
        forest = self.panel.forest
        if forest.node_count() and forest.hover.text().startswith("hover"):
            forest.hover.setText(forest.node_text(int(np.argmax(forest._layout.x))))

    def follow_live(self) -> None:
        self.timeline.setValue(self.timeline.maximum())
        self._on_timeline(self.timeline.maximum())

    def closeEvent(self, ev) -> None:  # noqa: N802
        self.source.close()
        super().closeEvent(ev)
