"""The four-score and parallel-sampling scenarios on the embedded SmolLM2 do what their step notes say,
and the figure view draws them as the PagedAttention paper's figures 4, 5 and 6."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from kvscope.scenario import ScenarioRunner, load_scenario
from kvscope.sources.live import LiveSource
from kvscope.ui.views.figure_view import FigureView


def run_scenario(smollm2, name: str) -> dict:
    model, tok, src = smollm2
    sc = load_scenario(name)
    engine = LLMEngine.from_hf_model(model, tok, EngineConfig(**sc.config), name=src.name)
    session = LiveSource(engine, ScenarioRunner(sc))
    recs = {}
    while session.has_work() and session.step_count < sc.steps:
        rec = session.step()
        recs[rec.step] = rec
    session.close()
    return recs


@pytest.fixture(scope="module")
def four_score(smollm2):
    return run_scenario(smollm2, "four-score")


@pytest.fixture(scope="module")
def parallel(smollm2):
    return run_scenario(smollm2, "parallel-sampling")


def tables(rec) -> dict:
    return {r.request_id: r.block_ids for r in rec.snapshot.requests if r.block_ids}


def test_four_score_follows_its_notes(four_score, smollm2):
    tok = smollm2[1]
    s1 = four_score[1].snapshot
    a = s1.request("0")
    assert [tok.decode([t]) for t in a.token_ids[:7]] == ["Four", " score", " and", " seven", " years", " ago", " our"]
    assert tables(four_score[1]) == {"0": (0, 1)} and list(s1.filled[:2]) == [4, 3]
    assert tables(four_score[2]) == {"0": (0, 1), "1": (2, 3)} and four_score[2].snapshot.filled[1] == 4
    assert tables(four_score[3])["0"] == (0, 1, 4)  # the new block comes after B's: interleaved
    assert tables(four_score[5])["1"] == (2, 3, 5)
    assert tables(four_score[7])["0"] == (0, 1, 4, 6)
    assert four_score[8].snapshot.request("0").status == "FINISHED_LENGTH"
    assert (four_score[8].snapshot.state == 1).sum() == 3  # A's full blocks stay cached
    assert four_score[9].snapshot.request("1").status == "FINISHED_LENGTH"


def test_parallel_sampling_follows_its_notes(parallel):
    s1 = parallel[1].snapshot
    assert tables(parallel[1]) == {"0": (0, 1), "0#1": (0, 1)} and list(s1.ref_cnt[:2]) == [2, 2]
    cow = [e for e in parallel[2].events if e.kind == "cow"]
    assert [(e.request_id, e.src_block_id, e.dst_block_id, e.num_slots) for e in cow] == [("0", 1, 2, 3)]
    assert tables(parallel[2]) == {"0": (0, 2), "0#1": (0, 1)}
    assert list(parallel[2].snapshot.ref_cnt[:3]) == [2, 1, 1]
    assert tables(parallel[3]) == {"0": (0, 2, 3), "0#1": (0, 1, 4)}
    assert tables(parallel[7]) == {"0": (0, 2, 3, 5), "0#1": (0, 1, 4, 6)}
    assert all(r.status.startswith("FINISHED") for r in parallel[10].snapshot.requests)


@pytest.fixture
def figure(qtbot):
    """Held strongly until qtbot has closed it (tests/kvscope/ui/test_views.py's ``alive`` says why)."""
    fig = FigureView()
    qtbot.addWidget(fig)
    yield fig


def test_the_figure_view_draws_them(figure, four_score, parallel, smollm2):
    tok = smollm2[1]
    fig = figure
    fig.resize(1200, 420)
    fig.show()
    fig.set_decode(tok.decode)
    fig.set_snapshot(four_score[1].snapshot)
    fig.set_requests(["0"])
    cells = fig.cells()["requests"]["0"]
    assert cells["logical"] == [(0, ["Four", "score", "and", "seven"]), (1, ["years", "ago", "our"])]
    assert cells["table"] == [(0, 0, 4, 1), (1, 1, 3, 1)] and cells["pending"][:2] == (1, 3)
    fig.set_snapshot(four_score[5].snapshot)
    fig.set_requests(["0", "1"])
    assert [row[1] for row in fig.cells()["requests"]["1"]["table"]] == [2, 3, 5]
    assert "interleave" in fig.caption.text()
    fig.set_snapshot(parallel[2].snapshot)
    fig.set_events(parallel[2].events)
    fig.set_requests(["0", "0#1"])
    t0, t1 = fig.cells()["requests"]["0"]["table"], fig.cells()["requests"]["0#1"]["table"]
    assert t0 == [(0, 0, 4, 2), (1, 2, 4, 1)] and t1 == [(0, 0, 4, 2), (1, 1, 4, 1)]
    assert "copy-on-write" in fig.caption.text()
