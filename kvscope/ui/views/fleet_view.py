"""The fleet window: several engines' caches watched together, and where a prompt would go.

``FleetWindow`` shows a ``FleetSource`` (sources/fleet): a table of the instances (state, cached blocks and tokens,
usage and load from their /metrics, stored and removed per second, the blocks another instance also holds, whether
their hashes could be reproduced), one prefix forest over the whole fleet in which each block is drawn as one small
square per instance holding it (in the instance's colour: a block two instances hold is two squares), the cached
blocks of each instance over time, and a prompt box: "where would it go", each instance's longest cached prefix of
the prompt, the prompt's blocks ringed in the forest. ``run_fleet_window`` runs it (``kvscope --fleet FILE`` or
several ``--attach``);

    python -m kvscope.ui.views.fleet_view --demo --screenshot docs/fleet.png

runs four kvscope engines on the embedded SmolLM2 in this process, publishing as vLLM does, and watches them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from kvscope.messages import bytes_text, count_text
from kvscope.sources.base import StepRecord
from kvscope.sources.fleet import FleetSource
from kvscope.sources.fleet_record import FleetRecord, InstanceRow
from kvscope.sources.fleet_route import RouteAnswer
from kvscope.sources.hash_check import published_low64
from kvscope.sources.remote_cache import ForestSnapshot, hash_text
from kvscope.ui.host import HostedWindow
from kvscope.ui.palette import DOWN, ROUTE_PATH, hex_colour, instance_colour
from kvscope.ui.views.prefix_forest import captioned, layout_forest

Tokenizer = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]
COLUMNS = (
    "instance",
    "state",
    "blocks",
    "tokens",
    "usage",
    "running / waiting",
    "stored / s",
    "removed / s",
    "also elsewhere",
    "prompt's prefix",
    "hashes",
)
SQUARE_PX = 11  # a holder's square, and the distance between the squares of one block's holders, in pixels


def holder_squares(xs: np.ndarray, holders: list[list[int]], step: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """One square per (block, holding instance), ``step`` apart around the block's x: (x, node index, instance)."""
    px, node, inst = [], [], []
    for i, hs in enumerate(holders):
        for k, h in enumerate(hs):
            px.append(xs[i] + (k - (len(hs) - 1) / 2) * step)
            node.append(i)
            inst.append(h)
    return np.array(px, dtype=float), np.array(node, dtype=int), inst


def path_edges(lay, on_path: set[int]) -> np.ndarray:
    """The forest's edges whose both ends are on the routed prompt's path ([2 * E, 2], as ``lay.edges``)."""
    index = {n.key: i for i, n in enumerate(lay.nodes)}
    pts = []
    for i, n in enumerate(lay.nodes):
        p = index.get(n.parent) if n.parent is not None else None
        if p is not None and i in on_path and p in on_path:
            pts += [(lay.x[p], lay.y[p]), (lay.x[i], lay.y[i])]
    return np.array(pts, dtype=float).reshape(-1, 2)


class DepthAxis(pg.AxisItem):
    """Blocks of depth are whole numbers: ticks at integers only (the holders' squares sit between them)."""

    def tickValues(self, minVal, maxVal, size):  # noqa: N802 - pyqtgraph's name
        levels = [
            (sp, [v for v in vals if float(v).is_integer()])
            for sp, vals in super().tickValues(minVal, maxVal, size)
            if sp >= 1
        ]
        return levels or [(1.0, [float(v) for v in range(int(np.ceil(minVal)), int(maxVal) + 1)])]


class FleetForestView(QWidget):
    """The fleet's one forest (``FleetIndex.forest``): blocks as squares in their holders' colours."""

    def __init__(self, source: FleetSource, decode: Decode | None = None, max_nodes: int = 3000) -> None:
        super().__init__()
        self.source, self.decode, self.max_nodes = source, decode, max_nodes
        self.plot = pg.PlotWidget(axisItems={"bottom": DepthAxis("bottom")})
        self.plot.hideAxis("left")
        self.plot.setLabel(
            "bottom",
            "blocks from the start of the prefix (each square: one instance holding the "
            "block; white: the prompt's cached path)",
        )
        self.plot.setMenuEnabled(False)
        self.edges = pg.PlotDataItem([], [], connect="pairs", pen=pg.mkPen((110, 116, 128), width=1))
        self.route_edges = pg.PlotDataItem([], [], connect="pairs", pen=pg.mkPen(*ROUTE_PATH, width=4))
        self.squares = pg.ScatterPlotItem(size=SQUARE_PX - 1, symbol="s", hoverable=True, pxMode=True, tip=None)
        self.squares.sigHovered.connect(self._on_hover)
        # the view ranges over the blocks themselves; their holders' squares sit a few pixels either side, so they
        # are placed again whenever the scale changes (a zoom, a resize)
        self.anchors = pg.ScatterPlotItem(size=1, pen=None, brush=None)
        for item in (self.edges, self.route_edges, self.anchors):
            self.plot.addItem(item)
        self.plot.addItem(self.squares, ignoreBounds=True)
        vb = self.plot.getViewBox()
        vb.sigXRangeChanged.connect(self._place_squares)
        vb.sigResized.connect(self._place_squares)
        self._holders: list[list[int]] = []
        self._brushes: list = []
        self.info, self.hover = captioned(self, self.plot, "hover a block: who holds it, its hash and tokens")
        self._layout = layout_forest(ForestSnapshot({}, 0, 0))
        self._node_of: np.ndarray = np.zeros(0, dtype=int)
        self.path: set[int] = set()

    def redraw(self) -> None:
        snap = self.source.index.forest.snapshot(self.max_nodes)
        lay = self._layout = layout_forest(snap)
        index = self.source.index
        holders = self._holders = [index.holder_instances(n.key[2]) for n in lay.nodes]
        self._brushes = [pg.mkBrush(*instance_colour(i)) for hs in holders for i in hs]
        self.anchors.setData(x=lay.x, y=lay.y)
        self._place_squares()
        self.edges.setData(lay.edges[:, 0], lay.edges[:, 1]) if len(lay.edges) else self.edges.setData([], [])
        on_path = {i for i, n in enumerate(lay.nodes) if published_low64(n.key[2]) in self.path}
        route = path_edges(lay, on_path)
        self.route_edges.setData(route[:, 0], route[:, 1]) if len(route) else self.route_edges.setData([], [])
        dup = sum(len(h) > 1 for h in holders)
        more = f" (showing {snap.shown} of {snap.total_blocks})" if snap.truncated else ""
        self.info.setText(
            f"{snap.total_blocks} distinct blocks{more}, {dup} of them held by two or more instances"
            + (f"; the prompt's cached path: {len(on_path)} blocks, in white" if self.path else "")
        )

    def _place_squares(self, *_args) -> None:
        lay = self._layout
        upp = self.plot.getViewBox().viewPixelSize()[0]  # data units per pixel across
        px, node, _inst = holder_squares(lay.x, self._holders, SQUARE_PX * upp)
        self._node_of = node
        self.squares.setData(
            x=px,
            y=lay.y[node] if len(node) else [],
            brush=self._brushes,
            pen=pg.mkPen((20, 22, 26), width=1),
            data=list(range(len(px))),
        )

    def node_text(self, i: int) -> str:
        n = self._layout.nodes[i]
        h = n.key[2]
        names = self.source.index.holder_names(h)
        text = f"block {hash_text(h)[:16]} · depth {n.depth} · {n.num_tokens} tokens · held by {', '.join(names)}"
        if n.token_ids and self.decode is not None:
            try:
                text += f"\n{self.decode(list(n.token_ids))!r}"
            except Exception:  # noqa: BLE001 - a foreign engine's ids may not fit our tokenizer
                text += f"\ntokens {list(n.token_ids[:24])}"
        elif n.token_ids:
            text += f"\ntokens {list(n.token_ids[:24])}"
        return text

    def deepest_text(self) -> str | None:
        """What hovering the deepest block would show (a screenshot has no mouse)."""
        if not len(self._layout.nodes):
            return None
        return self.node_text(int(np.argmax(self._layout.x)))

    def _on_hover(self, _item, points, _ev) -> None:
        if len(points):
            self.hover.setText(self.node_text(int(self._node_of[int(points[0].data())])))


class FleetTable(QTableWidget):
    """One row an instance; a row in trouble (gone, batches lost, hashes not reproducible) says so in red."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__(len(names), len(COLUMNS))
        self.setHorizontalHeaderLabels(COLUMNS)
        self.verticalHeader().hide()
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        head = self.horizontalHeader()
        for c in range(len(COLUMNS) - 1):
            head.setSectionResizeMode(c, QHeaderView.ResizeMode.ResizeToContents)
        head.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.ResizeMode.Stretch)
        self.route: dict[str, str] = {}
        rows = min(len(names), 8)  # every instance in view up to 8, then it scrolls
        self.setMinimumHeight(head.sizeHint().height() + rows * self.verticalHeader().defaultSectionSize() + 6)

    def show_rows(self, rows: Sequence[InstanceRow]) -> None:
        for r, row in enumerate(rows):
            m = row.metrics or {}
            usage = f"{100 * m['kv_cache_usage_perc']:.0f}%" if "kv_cache_usage_perc" in m else "-"
            load = (
                f"{m['num_requests_running']:.0f} / {m['num_requests_waiting']:.0f}"
                if "num_requests_running" in m
                else "-"
            )
            state = row.state if row.state == "up" else f"{row.state} {row.state_s:.0f} s"
            if row.restarts:
                state += f", restarted {row.restarts}x"
            if row.gaps_unrepaired:
                state += f", {count_text(row.batches_missing, 'batch', 'batches')} lost"
            cells = (
                row.name,
                state,
                f"{row.blocks:,}",
                f"{row.tokens:,}",
                usage,
                load,
                f"{row.stored_per_s:.1f}",
                f"{row.removed_per_s:.1f}",
                f"{row.shared_blocks:,}",
                self.route.get(row.name, ""),
                row.hashes,
            )
            for c, text in enumerate(cells):
                item = self.item(r, c)
                if item is None:
                    item = QTableWidgetItem()
                    self.setItem(r, c, item)
                item.setText(text)
                item.setToolTip(text)
            swatch = self.item(r, 0)
            swatch.setForeground(QBrush(QColor(*instance_colour(r))))
            bad = QBrush(QColor(*DOWN))
            self.item(r, 1).setForeground(bad if row.flags else QBrush())
            self.item(r, len(COLUMNS) - 1).setForeground(bad if not row.reproducible else QBrush())


class FleetWindow(HostedWindow):
    """The fleet view; ``on_step`` after each poll, ``route_prompt`` for the prompt box."""

    def __init__(
        self,
        source: FleetSource,
        tokenize: Tokenizer | None = None,
        decode: Decode | None = None,
        tokenizer_error: str | None = None,
        history: int = 3000,
    ) -> None:
        super().__init__()
        self.source, self.tokenize = source, tokenize
        names = [m.spec.name for m in source.members]
        title = QLabel(f"<b>{source.info.model_name}</b> · {source.spec.origin} · each colour one instance")
        self.table = FleetTable(names)
        self.forest = FleetForestView(source, decode)
        self.plots = pg.GraphicsLayoutWidget()
        # the legend is the title (a legend box would sit over the lines)
        key = " ".join(
            f"<span style='color:{hex_colour(instance_colour(i))}'>■ {n}</span>" for i, n in enumerate(names)
        )
        blocks = self.plots.addPlot(row=0, col=0, title=f"blocks {key} <span style='color:#d8dee9'>- - on 2+</span>")
        self.curves = [blocks.plot([], [], pen=pg.mkPen(*instance_colour(i), width=2)) for i in range(len(names))]
        self.dup_curve = blocks.plot([], [], pen=pg.mkPen((216, 222, 233), width=2, style=Qt.PenStyle.DashLine))
        blocks.setLabel("bottom", "seconds")
        self.series: dict[str, deque] = {k: deque(maxlen=history) for k in ["t", "dup", *names]}
        self.prompt = QLineEdit()
        self.prompt.setPlaceholderText(
            "Where would this prompt go? Type a prompt (or token ids: 1, 5, 9) and press Enter"
        )
        self.prompt.returnPressed.connect(self.route_box)
        self.kind = QComboBox()
        self.kind.addItems(["text", "token ids"])
        if tokenize is None:
            self.kind.setCurrentIndex(1)
            self.kind.setEnabled(False)
        go = QPushButton("Where would it go?")
        go.clicked.connect(self.route_box)
        self.answer = QLabel(
            tokenizer_error
            or "each instance's longest cached prefix of a prompt, as a precise prefix-aware router scores it"
        )
        self.answer.setWordWrap(True)
        self.totals = QLabel("waiting for events")
        self.totals.setWordWrap(True)
        self.notices = QLabel("")
        self.notices.setWordWrap(True)
        self.notices.setStyleSheet(f"color: {hex_colour(DOWN)};")
        self._notices: deque[str] = deque(maxlen=3)
        box = QHBoxLayout()
        box.addWidget(self.kind)
        box.addWidget(self.prompt, 1)
        box.addWidget(go)
        split = QSplitter()
        split.addWidget(self.forest)
        split.addWidget(self.plots)
        split.setSizes([900, 420])
        vsplit = QSplitter(Qt.Orientation.Vertical)
        vsplit.addWidget(self.table)
        vsplit.addWidget(split)
        vsplit.setSizes([self.table.minimumHeight(), 600])
        centre = QWidget()
        lay = QVBoxLayout(centre)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addWidget(title)
        lay.addWidget(vsplit, 1)
        lay.addLayout(box)
        lay.addWidget(self.answer)
        lay.addWidget(self.totals)
        lay.addWidget(self.notices)
        self.setCentralWidget(centre)
        self.setWindowTitle(f"kvscope · {source.info.model_name}")
        self.setMinimumSize(1024, 600)
        self.resize(1600, 1000)  # the main window's screenshot size (--window-size changes it)
        self.last: FleetRecord | None = None
        self.route_answer: RouteAnswer | None = None
        self._tokens: list[int] | None = None
        self._drawn = 0.0

    # -- each poll -------------------------------------------------------------------------------
    def on_step(self, rec: StepRecord | None, last: bool = False) -> None:
        """A step of the source (``ui.poll_driver``): the fleet's poll; None at the source's end."""
        if rec is not None:
            self.on_record(rec.fleet, last)

    def ask(self, route: str | list[int]) -> None:
        """A prompt (text, or token ids) in the box, answered as the caches change."""
        if isinstance(route, str):
            self.prompt.setText(route)
            self.route_box()
        else:
            self.kind.setCurrentIndex(1)
            self.prompt.setText(", ".join(map(str, route)))
            self.route_ids(list(route))

    def on_record(self, rec: FleetRecord, last: bool = False) -> None:
        """A poll: the table, totals, plots and notices; the forest twice a second (``last``: now)."""
        self.last = rec
        s = self.series
        s["t"].append(rec.t)
        s["dup"].append(rec.duplication.blocks)
        for row in rec.instances:
            s[row.name].append(row.blocks)
        t = list(s["t"])
        for curve, row in zip(self.curves, rec.instances):
            curve.setData(t, list(s[row.name]))
        self.dup_curve.setData(t, list(s["dup"]))
        if self._tokens is not None:
            self._route(self._tokens)  # the answer follows the caches
        self.table.show_rows(rec.instances)
        a, d = rec.in_all(), rec.duplication
        extra = f" ({bytes_text(d.extra_bytes)} beyond one copy each)" if d.extra_bytes else ""
        self.totals.setText(
            f"in all: {a['up']} of {a['instances']} instances up · {rec.blocks:,} cached blocks, "
            f"{rec.distinct_blocks:,} distinct · <b>{d.blocks:,} held by two or more instances</b>, "
            f"{d.extra_copies:,} copies more than one each{extra} · poll {rec.tick}"
        )
        for n in rec.notices:
            self._notices.append(f"poll {rec.tick}: {n}")
        self.notices.setText("<br>".join(self._notices))
        now = time.monotonic()
        if last or now - self._drawn > 0.5:  # the forest's layout is the costly part: twice a second
            self.forest.redraw()
            self._drawn = now

    # -- where would it go -----------------------------------------------------------------------
    def route_box(self) -> None:
        text = self.prompt.text().strip()
        if not text:
            return
        try:
            if self.kind.currentIndex() == 1 or self.tokenize is None:
                ids = [int(x) for x in text.replace(",", " ").split()]
            else:
                ids = self.tokenize(text)
        except ValueError:
            self.answer.setText("token ids are whole numbers separated by commas, e.g. 1, 5, 9")
            return
        self.route_ids(ids)

    def route_ids(self, ids: list[int]) -> None:
        self._tokens = ids
        self._route(ids)
        self.forest.redraw()

    def _route(self, ids: list[int]) -> None:
        ans = self.route_answer = self.source.route(ids)
        self.forest.path = ans.path
        self.answer.setText(f"<b>where would it go:</b> {ans.line()}")
        self.table.route = {
            s.instance: (f"{s.blocks} of {s.prompt_blocks} blocks" if s.blocks is not None else "not scored")
            for s in ans.scores
        }

    def prepare_screenshot(self) -> None:
        """Offscreen there is no mouse: show what hovering the deepest block would (for a screenshot)."""
        deepest = self.forest.deepest_text()
        if deepest and self.forest.hover.text().startswith("hover"):
            self.forest.hover.setText(deepest)

    def closeEvent(self, ev) -> None:  # noqa: N802
        self.source.close()
        super().closeEvent(ev)
