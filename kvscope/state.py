"""Qt-free view state of the window: what is selected, which step is shown, how often to redraw.

The window only maps widgets to and from this state, so tests can drive it without Qt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.inspect.snapshot import BlockState

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
    view_step: int | None = None  # None: follow the live run (the selection is the requests panel's own)
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


def status_text(snap, info=None, live: bool = True) -> str:
    """The status bar at one step. "cached" means what it means in the legend and the plots:
    free blocks that still hold a hash (reusable by a prefix hit until evicted)."""
    c = snap.counters
    q = c.get("prefix_cache_queries", 0)
    hit = f"{100 * c.get('prefix_cache_hits', 0) / q:.0f}%" if q else "–"
    cached = int(np.count_nonzero(snap.state == BlockState.CACHED))
    total, null = usable_blocks(snap, info)
    text = (
        f"{'' if live else 'looking back: '}step {snap.step} · free {c.get('num_free_blocks', 0):,}/"
        f"{total:,} blocks{null} ({cached:,} cached) · usage "
        f"{100 * c.get('kv_cache_usage_perc', 0):.1f}% · prefix hit rate {hit} · running "
        f"{c.get('num_requests_running', 0)} waiting {c.get('num_requests_waiting', 0)}"
    )
    if c.get("num_requests_swapped"):
        text += f" swapped {c['num_requests_swapped']}"
    text += f" · preemptions {c.get('num_preemptions', 0)}"
    if info is not None and info.block_bytes:
        kv = "" if info.kv_cache_dtype == "auto" else f" {info.kv_cache_dtype}"
        text += (
            f" · KV{kv} {info.block_bytes / 1024:.1f} KiB/block, capacity {info.num_blocks * info.block_size:,} tokens"
        )
    return text


def usable_blocks(snap, info=None) -> tuple[int, str]:
    """(the blocks a request can get, a note on those it cannot): a probed vLLM keeps block 0 as its null block
    (``num_reserved_blocks``, counted where the pool is read), never free and never counted in its usage, so its
    free count and usage read against the other blocks."""
    c = snap.counters
    total = int(c.get("num_blocks", snap.num_blocks))
    reserved = int(c.get("num_reserved_blocks", 0))
    if reserved:
        return total - reserved, f" usable ({reserved} reserved: vLLM's null block)"
    return total, ""


def short_status(snap, info=None, live: bool = True) -> str:
    """The status in one short line (presentation's, beside the keys): the step, the free blocks, the hit
    rate, what runs and waits, the preemptions; the same counters as ``status_text``."""
    c = snap.counters
    q = c.get("prefix_cache_queries", 0)
    hit = f"{100 * c.get('prefix_cache_hits', 0) / q:.0f}%" if q else "–"
    total, null = usable_blocks(snap, info)
    text = (
        f"{'' if live else 'looking back: '}step {snap.step} · free {c.get('num_free_blocks', 0):,}/{total:,}"
        f"{' usable' if null else ''} · hit "
        f"rate {hit} · running {c.get('num_requests_running', 0)} · waiting {c.get('num_requests_waiting', 0)}"
    )
    if c.get("num_requests_swapped"):
        text += f" · swapped {c['num_requests_swapped']}"
    return text + f" · preempted {c.get('num_preemptions', 0)}"
