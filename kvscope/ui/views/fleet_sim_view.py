"""The fleet window: N simulated instances' pools side by side, small, and each request's route as it arrives
(``kvscope --workload FILE --instances N --router POLICY``).

Each instance is a panel: its pool as one small image (one texel a block, coloured by state as the block
grid colours it; a pool bigger than the panel is shrunk by priority, so a used block is never hidden by
free ones), its share of the requests, its queue and its hit rate. The router's latest decision is the
banner above the pools (which request, where it went, and what the router read: each pool's cached
prefix for the prefix routers, each queue for the others), and the panel it went to is outlined; the
log below keeps the last ones.

Like the attach window, this one steps its source (``kvscope.sources.fleet_sim.SimFleetSource``) on a timer on
the GUI thread (``ui.poll_driver``): the fleet is simulated, and what is drawn is read from its engines between
events. The speed box sets how much virtual time a step plays; Run/Pause holds the driver.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QRectF
from PySide6.QtWidgets import (
    QComboBox,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from engine.inspect.snapshot import BlockState
from kvscope.sources.fleet_sim import FleetFrame, InstanceFrame, SimFleetSource
from kvscope.ui.host import HostedWindow
from kvscope.ui.palette import ROUTE_HIGHLIGHT, STATES, hex_colour
from kvscope.ui.views.grid_cells import codes_lut, to_grid
from kvscope.ui.views.grid_overview import OverviewView
from kvscope.ui.views.legend import swatch

SHOWN_STATES = (BlockState.FREE, BlockState.CACHED, BlockState.USED, BlockState.SHARED)
SPEEDS = (("1x", 1.0), ("10x", 10.0), ("100x", 100.0), ("max", None))  # virtual seconds a wall second
ROW_MAX = 8  # panels a row
LOG_LINES = 200


def route_text(route) -> str:
    """One routing decision in words: the request, where it went, and what the router read (each pool's cached
    prefix for the prefix routers; every router's view of the queues), the chosen instance's in brackets."""

    def each(values) -> str:
        return " | ".join(f"[{v}]" if i == route.instance else str(v) for i, v in enumerate(values))

    text = (
        f"L{route.line} ({route.prompt_tokens:,} prompt tokens) at {route.arrival_s:,.1f} s → instance {route.instance}"
    )
    if route.cached_blocks is not None:
        text += f" · cached prefix, blocks: {each(route.cached_blocks)}"
    return text + f" · requests queued: {each(route.loads)}"


def best_columns(n: int, width: float, height: float, text_px: float = 60.0) -> int:
    """The columns that make n panels' pools (squares, with ``text_px`` of text each) largest in the area."""

    def side(cols: int) -> float:
        return min(width / cols, height / math.ceil(n / cols) - text_px)

    return max(range(1, n + 1), key=lambda c: (side(c), -c))


class PoolPanel(QFrame):
    """One instance: its pool, small, and its numbers; outlined when it got the latest request."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.setObjectName("pool")
        self.title = QLabel(f"<b>instance {index}</b>")
        self.pool = OverviewView()
        self.pool.setToolTip(f"instance {index}'s KV pool, one texel a block (shrunk by priority when bigger)")
        self.pool.set_frame(QRectF())
        self.stats = QLabel("")
        self.stats.setWordWrap(True)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 3, 4, 3)
        lay.setSpacing(2)
        lay.addWidget(self.title)
        lay.addWidget(self.pool, 1)
        lay.addWidget(self.stats)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.set_highlight(False)

    def set_highlight(self, on: bool) -> None:
        self.highlighted = on
        colour = hex_colour(ROUTE_HIGHLIGHT) if on else "#3b4252"
        self.setStyleSheet(f"QFrame#pool {{ border: {3 if on else 1}px solid {colour}; border-radius: 4px; }}")

    def show_frame(self, f: InstanceFrame, share: float) -> None:
        codes, lut = codes_lut(f.states)
        self.pool.set_grid(to_grid(codes, len(lut) - 1), lut)
        hit = "-" if f.hit_rate is None else f"{f.hit_rate:.1%}"
        self.title.setText(f"<b>instance {f.index}</b> · {share:.0%} of requests")
        self.stats.setText(f"used {f.usage:.0%} · {f.running} running · {f.waiting} waiting · hit {hit}")


class SimFleetWindow(HostedWindow):
    """``on_step`` after each slice of events (its record's frame)."""

    def __init__(self, source: SimFleetSource) -> None:
        super().__init__()
        self.source = source
        n = len(source.fleet.instances)
        self.title = QLabel(f"<b>fleet: {source.title}</b>")
        self.title.setWordWrap(True)
        legend = QHBoxLayout()
        legend.addWidget(QLabel(source.pool_text + " · "))
        for s in SHOWN_STATES:
            sw = QLabel()
            sw.setPixmap(swatch((STATES[s].colour,)))
            sw.setToolTip(STATES[s].meaning)
            legend.addWidget(sw)
            legend.addWidget(QLabel(STATES[s].name))
        outline = QLabel(f"<span style='color:{hex_colour(ROUTE_HIGHLIGHT)}'>▢</span> got the latest request")
        legend.addWidget(outline)
        legend.addStretch(1)
        self.route = QLabel("no request routed yet")
        self.route.setWordWrap(True)
        self.route.setStyleSheet("font-weight: bold; padding: 4px; background: #2e3440; border-radius: 4px;")
        self.panels = [PoolPanel(i) for i in range(n)]
        self.area = QWidget()  # the pools, in the columns that make them largest at the window's size
        self.grid = QGridLayout(self.area)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setSpacing(6)
        self.columns = 0
        self.arrange(min(n, ROW_MAX))
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(LOG_LINES)
        self.log.setPlaceholderText("each request's route, as it arrives")
        self.log.setFixedHeight(self.log.fontMetrics().lineSpacing() * 6 + 12)
        self.run_button = QPushButton("Pause")
        self.speed = QComboBox()
        self.speed.addItems([name for name, _ in SPEEDS])
        self.speed.setToolTip("virtual seconds played per second (max: as fast as this machine simulates)")
        self.status = QLabel("")
        controls = QHBoxLayout()
        controls.addWidget(self.run_button)
        controls.addWidget(QLabel("speed"))
        controls.addWidget(self.speed)
        controls.addWidget(self.status, 1)
        centre = QWidget()
        lay = QVBoxLayout(centre)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addWidget(self.title)
        lay.addLayout(legend)
        lay.addWidget(self.route)
        lay.addWidget(self.area, 1)
        lay.addWidget(self.log)
        lay.addLayout(controls)
        self.setCentralWidget(centre)
        self.setWindowTitle(f"kvscope · fleet of {n}")
        self.setMinimumSize(800, 500)
        self.resize(1500, 900)
        self._logged = 0  # routes already in the log (the fleet keeps a window of the latest)
        self.last_frame: FleetFrame | None = None
        self.speed.currentTextChanged.connect(lambda name: source.set_speed(dict(SPEEDS)[name]))
        self.show_frame(source.frame())

    def bind(self, driver) -> None:
        """The Run/Pause button holds ``driver`` (``ui.poll_driver.PollDriver``)."""
        self._driver = driver
        self.run_button.clicked.connect(self._toggle)

    def _toggle(self) -> None:
        self._driver.toggle()
        self.run_button.setText("Pause" if self._driver.running else "Run")

    def on_step(self, rec, last: bool = False) -> None:
        """A slice of events (``rec.sim_fleet``), or the trace's end (None)."""
        if rec is not None:
            self.show_frame(rec.sim_fleet)
        if rec is None or rec.sim_fleet.done:
            self.run_button.setEnabled(False)  # the trace is over

    def prepare_screenshot(self) -> None:
        if self.last_frame is not None:
            self.show_frame(self.last_frame)  # laid out at its size now: the pools' images fit their panels

    def arrange(self, cols: int) -> None:
        if cols == self.columns:
            return
        self.columns = cols
        for p in self.panels:
            self.grid.removeWidget(p)
        for i, p in enumerate(self.panels):
            self.grid.addWidget(p, i // cols, i % cols)

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        size = self.area.size()
        self.arrange(best_columns(len(self.panels), size.width(), size.height()))

    def show_frame(self, frame: FleetFrame) -> None:
        self.last_frame = frame
        total = max(frame.routed, 1)
        latest = frame.routes[-1] if frame.routes else None
        for p, f in zip(self.panels, frame.instances):
            p.show_frame(f, f.routed / total)
            p.set_highlight(latest is not None and latest.instance == p.index)
        if latest is not None:
            self.route.setText("latest route: " + route_text(latest))
        new = frame.routed - self._logged
        for r in list(frame.routes)[-min(new, len(frame.routes)) :] if new > 0 else []:
            self.log.appendPlainText(route_text(r))
        self._logged = frame.routed
        hit = "-" if frame.hit_rate is None else f"{frame.hit_rate:.1%}"
        skipped = f" ({frame.skipped} skipped: too long or too big)" if frame.skipped else ""
        self.status.setText(
            f"virtual {frame.clock:,.1f} s · {frame.routed:,} of {frame.requests:,} requests routed"
            f"{skipped} · fleet hit rate {hit}" + (" · done" if frame.done else "")
        )
