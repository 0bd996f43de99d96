"""One colour language: a block's state has one colour in every view that draws it (issue 25).

The grid (its colour table), the legend (its swatches), the paper's figure (its ref cells) and the request
panel's block table are walked over a few scenarios' steps on the tiny model; the audit's flagged blocks are
red in all of them. The
fragmentation figure's classes are all held by a request, so all greens, and none is a state's colour but used.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine
from engine.inspect.snapshot import BlockState
from kvscope.scenario import ScenarioRunner, load_scenario
from kvscope.sources.live import LiveSource
from kvscope.ui import palette
from kvscope.ui.views.figure_view import FigureView
from kvscope.ui.views.grid_cells import codes_for
from kvscope.ui.views.legend import LegendView
from kvscope.ui.views.request_panel import BlockTableView
from tests.conftest import byte_tokenizer, make_tiny_hf


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_hf(max_position_embeddings=4096, vocab_size=49152), byte_tokenizer()


@pytest.mark.parametrize(
    "name", ["shared-system-prompt", "parallel-sampling", "lab-caching-changes-output", "leak-hunt"]
)
def test_a_blocks_state_is_one_colour_in_every_view(qtbot, tiny, name):
    model, tok = tiny
    sc = load_scenario(name)
    source = LiveSource(
        LLMEngine.from_hf_model(model, tok, EngineConfig(**sc.config), name="tiny"), ScenarioRunner(sc), audit=True
    )
    legend, figure, table = LegendView(), FigureView(), BlockTableView()
    for w in (legend, figure, table):
        qtbot.addWidget(w)
    checked = flagged_seen = 0
    for _ in range(min(sc.steps or 24, 24)):
        if not source.has_work():
            break
        rec = source.step()
        snap = source.engine.snapshot()
        flagged = np.array(rec.audit.bad_blocks, np.int64) if rec.audit and not rec.audit.ok else None
        codes, lut = codes_for(snap, "state", flagged)
        grid = {b: tuple(int(v) for v in lut[codes[b]]) for b in range(snap.num_blocks)}
        legend.set_snapshot(snap, flagged, rec.audit.kinds_names() if flagged is not None else None)
        swatches = {e.name: e.colours[0] for e in legend.entries}
        for st in (BlockState.FREE, BlockState.CACHED, BlockState.USED, BlockState.SHARED):
            assert swatches[palette.STATES[st].name] == palette.STATE_COLOURS[st]
        figure.set_snapshot(snap, flagged)
        figure.set_requests([r.request_id for r in snap.requests if r.block_ids][:2])
        for b, rgb in figure.cells().get("state_colours", {}).items():
            assert rgb == grid[b], f"step {rec.step}, block {b}: the figure says {rgb}, the grid {grid[b]}"
            checked += 1
        for r in snap.requests:
            table.show_table(snap, r.block_ids, set(flagged.tolist()) if flagged is not None else ())
            for b, rgb in table.colours.items():
                assert rgb == grid[b], f"step {rec.step}, block {b}: the block table says {rgb}, the grid {grid[b]}"
                checked += 1
        if flagged is not None:
            flagged_seen += 1
            red = [e for e in legend.entries if e.colours[0] == palette.LEAKED]
            assert red and red[0].count == len(set(flagged.tolist()))
            assert all(grid[int(b)] == palette.LEAKED for b in flagged)
    source.close()
    assert checked > 0
    if name in ("lab-caching-changes-output", "leak-hunt"):
        assert flagged_seen > 0  # the audit flagged blocks, and they were red everywhere


def test_the_fragmentation_figures_classes_are_held_greens_and_no_states_but_used():
    frags = {k: c.colour for k, c in palette.FRAGMENTS.items()}
    assert frags["used"] == palette.USED
    others = {c for s, c in palette.STATE_COLOURS.items() if s is not BlockState.USED}
    assert not others & set(frags.values())
    assert all(g > r and g > b for r, g, b in frags.values())  # greens: a slot held by a request
