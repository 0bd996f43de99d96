"""The garbage collector's settings for an engine process (engine.gc_policy)."""

from __future__ import annotations

import gc
import weakref

from engine.gc_policy import GEN0_THRESHOLD, tune_gc


def test_tune_gc_freezes_what_is_alive_and_collects_the_young_less_often():
    before = gc.get_threshold()
    try:

        class Cycle:
            pass

        a = Cycle()
        a.me = a  # a cycle made before: frozen with the rest
        alive = weakref.ref(a)
        tune_gc()
        frozen = gc.get_freeze_count()
        assert frozen > 0 and gc.get_threshold()[0] == GEN0_THRESHOLD
        assert gc.get_threshold()[1:] == before[1:]
        del a
        gc.collect()
        assert alive() is not None  # frozen: out of the collector's sight
        tune_gc()  # a second load: the earlier freeze is undone first, so that cycle is collected now
        assert gc.get_freeze_count() < frozen + 1000 and gc.get_threshold()[0] == GEN0_THRESHOLD
        assert alive() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
