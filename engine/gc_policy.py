"""The garbage collector's settings for a process that steps an engine.

An engine step allocates hundreds of small container objects (scheduled requests, events, snapshot
rows) and frees nearly all of them again by reference counting. CPython's default collects the
youngest generation every 700 net allocations, and each such pass, with the older generations every
tenth, walks objects that are not garbage: in a window's engine process at 65,536 blocks this took a
snapshot from 5 ms to 8.5 ms (median), and more at p90. vLLM's engine core freezes its start-up heap
for the same reason. Here: what is alive after a model loads (weights' Python objects, the pool's
block objects) is frozen out of the collector's sight, and the youngest generation is collected after
50,000 net allocations. Reference counting still frees everything acyclic at once; cycles wait longer.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def tune_gc(gen0: int = GEN0_THRESHOLD) -> None:
    """Call after loading a model: unfreezes what an earlier call froze (so that a replaced engine's
    cycles can be collected), collects, freezes what is alive, and raises the youngest threshold."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 1), g1, g2)
