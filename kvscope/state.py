"""Qt-free view state of the window: what is selected, which step is shown, how often to redraw.

The window only maps widgets to and from this state, so tests can drive it without Qt.
"""
from __future__ import annotations

from dataclasses import dataclass, field

REDRAW_MS = 33  # coalesce: at most ~30 redraws per second, however fast the engine steps
MAX_REDRAW_MS = 250
REDRAW_DUTY = 0.25  # the GUI thread's share of the time at most


@dataclass
class RedrawPacer:
    """Spaces redraws so that the GUI thread's CPU share stays near ``duty``.

    With the engine on a thread of this process, the GUI's work holds the GIL the engine
    needs; ``thread_time`` over wall time since the last redraw measures exactly that share.
    """

    interval_ms: int = REDRAW_MS
    base_ms: int = REDRAW_MS
    max_ms: int = MAX_REDRAW_MS
    duty: float = REDRAW_DUTY
    _mark: tuple[float, float] | None = None

    def after_redraw(self, wall: float, cpu: float) -> int:
        """Call after each redraw with ``perf_counter()`` and ``thread_time()``; returns the next interval."""
        last, self._mark = self._mark, (wall, cpu)
        if last is None or wall - last[0] <= 0:
            return self.interval_ms
        share = (cpu - last[1]) / (wall - last[0])
        if share > self.duty:
            self.interval_ms = min(self.max_ms, int(self.interval_ms * 1.5) + 1)
        elif share < self.duty / 2:
            self.interval_ms = max(self.base_ms, int(self.interval_ms / 1.25))
        return self.interval_ms


@dataclass
class ViewState:
    view_step: int | None = None  # None: follow the live run
    selected_request: str = ""
    pacer: RedrawPacer = field(default_factory=RedrawPacer)

    @property
    def live(self) -> bool:
        return self.view_step is None

    def follow_live(self) -> None:
        self.view_step = None

    def timeline_moved(self, steps: list[int], pos: int) -> int | None:
        """The slider moved to index ``pos`` of ``steps``; returns the step to show (None: live)."""
        if not steps or pos >= len(steps) - 1:
            self.view_step = None
        else:
            self.view_step = steps[max(0, pos)]
        return self.view_step

    def timeline_position(self, steps: list[int]) -> int:
        """Where the slider belongs for the current view."""
        if self.view_step is None or not steps:
            return max(len(steps) - 1, 0)
        import bisect
        return min(bisect.bisect_left(steps, self.view_step), len(steps) - 1)

    def reset(self) -> None:
        self.view_step = None
        self.selected_request = ""
