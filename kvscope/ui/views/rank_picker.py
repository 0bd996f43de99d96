"""Which data-parallel rank of a probed vLLM the window shows: a box on the toolbar, there only with two or more.

Each rank of a vLLM started with ``--data-parallel-size N`` has its own engine core, scheduler and pool; the
window shows one at a time (its pool, requests, audit and timeline) while kvscope reads them all. Picking another
rank loads it as a fresh source: its timeline starts there.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox


class RankPicker(QComboBox):
    rank_chosen = Signal(int)

    def __init__(self) -> None:
        super().__init__()
        self.setToolTip(
            "vLLM runs several data-parallel ranks, each with its own pool: the one shown (kvscope reads them all; "
            "Pause and Step hold the rank shown)"
        )
        self.activated.connect(lambda i: self.rank_chosen.emit(int(self.itemData(i))))

    def set_ranks(self, ranks: list[int], shown: int) -> None:
        self.blockSignals(True)
        self.clear()
        for r in ranks:
            self.addItem(f"DP rank {r} of {len(ranks)}", r)
        if shown in ranks:
            self.setCurrentIndex(ranks.index(shown))
        self.blockSignals(False)
