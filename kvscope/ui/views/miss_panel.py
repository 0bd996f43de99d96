""" "Why did it miss?": the miss explainer's answer for one request, large enough for a room.

The reason and the first block that missed, and where the prompt parts from the cache: the token that differs in
the prompt and in the cache, side by side in large text, each in a box with the text around it (a space shown as
"␣", so " You" and "You" read apart). The box is the marker: no character (a chat template has "|" of its own).
Reasons with no token to show (nothing cached, evicted, the prompt ends in the block) say the reason in words.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine.inspect.cache_miss import CacheMiss, SeamSide
from kvscope.ui import palette
from kvscope.ui.style import text_scale

REASONS = {  # the reason's words, as the lesson says them
    "prompt_ends_in_block": "the prompt ends inside this block (only full blocks are cached)",
    "evicted": "the block was cached, then evicted",
    "different_identity": "the same tokens, under another cache salt or model",
    "different_tokenization": "the same text, other token ids",
    "shifted": "the cached text sits a few tokens later: the block boundaries moved",
    "differs_at": "a cached chain differs from the prompt at one token",
    "no_cached_block": "nothing cached continues the prompt here",
}


def visible(text: str) -> str:
    """A token's text with its spaces and line ends shown."""
    return text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") or "∅"


def _label(wrap: bool = True) -> QLabel:
    w = QLabel("")
    w.setWordWrap(wrap)
    w.setTextFormat(Qt.TextFormat.PlainText)
    w.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
    return w


class _Side(QWidget):
    """One side of the seam: a caption, the text before, the token in a box, the text after."""

    def __init__(self, caption: str, colour) -> None:
        super().__init__()
        self.caption = _label()
        self.caption.setText(caption)
        self.before, self.after = _label(), _label()
        self.token = QLabel("")
        self.token.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.token.setFrameShape(QFrame.Shape.Box)
        self.colour = colour
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.caption)
        lay.addWidget(self.before)
        lay.addWidget(self.token, 0, Qt.AlignmentFlag.AlignLeft)
        lay.addWidget(self.after)
        lay.addStretch(1)

    def show_side(self, side: SeamSide | None) -> None:
        self.setVisible(side is not None)
        if side is None:
            return
        shown = side.before.replace("\n", "⏎").replace("\t", "⇥")
        self.before.setText(f"…{shown}" if side.before else "(the prompt's start)")
        self.token.setText(visible(side.token))
        self.token.setToolTip(f"token id {side.token_id}")
        self.after.setText(f"{side.after.replace(chr(10), '⏎')}…" if side.after else "")

    def apply_sizes(self, body: int, big: int) -> None:
        c = palette.hex_colour(self.colour)
        self.caption.setStyleSheet(f"font-size: {body}px; font-weight: bold; color: {c}")
        for w in (self.before, self.after):
            w.setStyleSheet(f"font-size: {body}px; color: #8a93a5")
        self.token.setStyleSheet(
            f"font-size: {big}px; font-weight: bold; font-family: monospace; color: #15171b; "
            f"background: {c}; border: 3px solid #ffffff; padding: 4px 14px"
        )


class MissPanel(QWidget):
    """``show_miss(request_id, miss, hit)``: ``miss`` a ``CacheMiss`` (None: every full block hit), ``hit`` the
    line of how many prompt tokens came from the cache; ``show_text(text)`` for what is not a miss to explain."""

    def __init__(self) -> None:
        super().__init__()
        self.request_id = ""
        self.question = _label()
        self.reason = _label()
        self.hit = _label()
        self.prompt_side = _Side("in this prompt", palette.LEAKED)
        self.cached_side = _Side("in the cache", palette.CACHED)
        self.detail = _label()
        self.grid = QGridLayout(self)
        self.grid.setContentsMargins(12, 8, 12, 8)
        self.grid.setHorizontalSpacing(40)
        self.grid.setVerticalSpacing(8)
        self.wide: bool | None = None
        self._arrange(False)
        self.apply_sizes()
        self.show_text("Why did it miss? Select a request: its first missed block, why, and the tokens that differ.")

    def _arrange(self, wide: bool) -> None:
        """Tall (a lesson's panel in presentation): the question, the hits, the reason, the two sides, the detail,
        one under the other. Wide (a tab under the grid: short and wide): the question, hits and reason beside the
        two sides, the detail under them all."""
        if wide == self.wide:
            return
        self.wide = wide
        g = self.grid
        for w in (self.question, self.hit, self.reason, self.prompt_side, self.cached_side, self.detail):
            g.removeWidget(w)
        for r in range(g.rowCount()):
            g.setRowStretch(r, 0)
        for c in range(g.columnCount()):
            g.setColumnStretch(c, 0)
        if wide:
            g.addWidget(self.question, 0, 0)
            g.addWidget(self.hit, 1, 0)
            g.addWidget(self.reason, 2, 0)
            g.addWidget(self.prompt_side, 0, 1, 3, 1)
            g.addWidget(self.cached_side, 0, 2, 3, 1)
            g.addWidget(self.detail, 3, 0, 1, 3)
            g.setColumnStretch(0, 3)
            g.setColumnStretch(1, 2)
            g.setColumnStretch(2, 2)
            g.setRowStretch(4, 1)
        else:
            g.addWidget(self.question, 0, 0, 1, 2)
            g.addWidget(self.hit, 1, 0, 1, 2)
            g.addWidget(self.reason, 2, 0, 1, 2)
            g.addWidget(self.prompt_side, 3, 0)
            g.addWidget(self.cached_side, 3, 1)
            g.addWidget(self.detail, 4, 0, 1, 2)
            g.setColumnStretch(0, 1)
            g.setColumnStretch(1, 1)
            g.setRowStretch(5, 1)

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        self._arrange(self.width() > 2 * self.height())

    def apply_sizes(self, body: int | None = None) -> None:
        """Text at ``body`` px (default: 12 px times the text scale), the tokens at twice that."""
        body = body or round(12 * text_scale())
        self.question.setStyleSheet(f"font-size: {round(body * 1.2)}px; font-weight: bold")
        for w in (self.reason, self.hit, self.detail):
            w.setStyleSheet(f"font-size: {body}px")
        for side in (self.prompt_side, self.cached_side):
            side.apply_sizes(body, 2 * body)

    def show_text(self, text: str) -> None:
        self.question.setText(text)
        for w in (self.reason, self.hit, self.detail, self.prompt_side, self.cached_side):
            w.hide()

    def show_miss(self, request_id: str, miss: CacheMiss | None, hit: str) -> None:
        self.request_id = request_id
        self.question.setText(f"Why did request {request_id} miss the prefix cache?")
        self.hit.setText(hit)
        self.hit.show()
        if miss is None:
            self.reason.setText("It did not: every full block of its prompt was found.")
            self.reason.show()
            for w in (self.detail, self.prompt_side, self.cached_side):
                w.hide()
            return
        self.reason.setText(
            f"First miss: block {miss.block_index}, at token {miss.token_position}: {miss.reason} "
            f"({REASONS.get(miss.reason, miss.reason)})"
        )
        self.reason.show()
        self.prompt_side.show_side(miss.prompt_side)
        self.cached_side.show_side(miss.cached_side)
        self.detail.setText(miss.detail)
        self.detail.show()

    def clipped(self) -> list[str]:
        """The texts shown shorter than they need."""
        labels = [self.question, self.reason, self.hit, self.detail]
        for side in (self.prompt_side, self.cached_side):
            labels += [side.caption, side.before, side.after]
        out = [w.text()[:40] for w in labels if w.isVisible() and w.height() < w.heightForWidth(w.width())]
        for side in (self.prompt_side, self.cached_side):
            t = side.token
            if t.isVisible() and t.width() < t.sizeHint().width():
                out.append(t.text())
        return out
