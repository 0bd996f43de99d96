"""The window's diagnosis state (Qt-free): the miss text, a block's story over the history, the
fragmentation accounting, and the timing series the labs read."""

from __future__ import annotations

from engine import SamplingParams
from engine.inspect.block_story import block_story
from engine.inspect.fragmentation import layouts, pool_counts
from kvscope.diagnosis import Diagnosis, comparison_prompts
from kvscope.history import RunHistory

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHARED = list(range(10, 18))  # two blocks of 4


def run(engine, prompts: dict[str, list[int]], at: dict[str, int] | None = None, step_s: float = 0.01):
    """Step an engine to the end, recording into a history and a diagnosis as the window does."""
    h, d, all_events = RunHistory(), Diagnosis(), []
    at, pending = at or {}, dict(prompts)
    while pending or engine.has_unfinished():
        for rid in [r for r in pending if at.get(r, 0) <= engine.step_count]:
            engine.add_request(pending.pop(rid), GREEDY, request_id=rid)
        out = engine.step()
        snap = engine.snapshot()
        all_events.append((snap.step, list(out.events)))
        h.record(snap, step_s, None, list(out.events))
        d.feed(snap.step, out.events, snap)
    return h, d, all_events


def test_the_miss_text_names_the_first_missed_block_and_its_reason(tiny_engine):
    engine = tiny_engine()
    h, d, _ = run(engine, {"a": SHARED + [1, 2, 3, 4, 5, 6, 7, 8], "b": SHARED + [1, 2, 9, 9, 5, 6, 7, 8]}, at={"b": 3})
    snap = h.latest
    text_a, text_b = d.miss_text(snap, "a"), d.miss_text(snap, "b")
    assert "0 of 16 prompt tokens hit" in text_a and "nothing cached" in text_a
    assert "8 of 16 prompt tokens hit (2 block(s))" in text_b
    assert "block 2 (differs_at)" in text_b and "at token 10" in text_b
    assert "select a request" in d.miss_text(snap, "")
    assert "off in this engine" in Diagnosis(prefix_caching=False).miss_text(snap, "a")


def test_a_block_story_from_the_history_is_the_story_of_every_event(tiny_engine):
    engine = tiny_engine()
    h, d, events = run(engine, {"a": SHARED + [1, 2, 3], "b": SHARED + [4, 5, 6]}, at={"b": 2})
    for block in range(6):
        assert d.story(block, h) == block_story(block, events)
    first = d.story(0, h)
    assert first[0].kind == "allocated" and any(ln.kind == "hit" for ln in first)  # b hit a's first block
    upto = d.story(0, h, up_to=1)
    assert upto == block_story(0, [(s, e) for s, e in events if s <= 1]) and len(upto) < len(first)


def test_the_history_times_the_first_token_and_counts_decode_tokens(tiny_engine):
    engine = tiny_engine()
    h, _, _ = run(engine, {"a": [1, 2, 3], "b": list(range(20, 40))}, at={"b": 4}, step_s=0.5)
    ttft = {rid: s for _, s, rid in h.ttft}
    assert set(ttft) == {"a", "b"} and ttft["a"] == ttft["b"] == 0.5  # one prefill step each
    decode = sum(v * 0.5 for v in h.series["decode_tokens_per_s"])
    assert round(decode) == 2 * (GREEDY.max_tokens - 1)  # every token but the first of each request


def test_fragmentation_accounting_of_both_layouts(tiny_engine):
    engine = tiny_engine()
    engine.add_request(list(range(1, 11)), GREEDY, request_id="x")  # 10 tokens: 3 blocks of 4
    engine.add_request(list(range(1, 5)) + [99], GREEDY, request_id="y")  # 5 tokens: 2 blocks
    engine.step()
    snap = engine.snapshot()
    contiguous, paged = layouts(snap, 64)
    used = {r.request_id: r.used for r in paged.rows}
    assert used == {"x": 10, "y": 5}
    assert [(r.wasted, r.reserved) for r in paged.rows] == [(2, 0), (3, 0)]
    # a 64-slot reservation of whole blocks: the rest of the last written block is wasted inside it, as paged
    assert [(r.wasted, r.reserved) for r in contiguous.rows] == [(2, 52), (3, 56)]
    c = pool_counts(snap)
    # y hit x's first block (tokens 1-4): physical blocks are counted once
    assert c["blocks_held"] == 4 and c["used_slots"] == 11 and c["wasted_slots"] == 5 and c["reserved_slots"] == 0


def test_split_slots_is_the_one_rule_of_rows_and_pool():
    from engine.inspect.fragmentation import held_slots, split_slots

    assert split_slots(10, 12, 4) == (10, 2, 0) and split_slots(10, 64, 4) == (10, 2, 52)
    assert split_slots(0, 4, 4) == (0, 0, 4) and split_slots(8, 8, 4) == (8, 0, 0)
    assert held_slots("contiguous", 10, 62, 4) == 64 and held_slots("paged", 10, 62, 4) == 12


def test_a_contiguous_runs_figure_header_caption_and_json_agree(tiny_engine):
    """Issue 34: the header said "0 wasted, 1,251 reserved", the caption "35 wasted, 1,216 reserved". One rule
    now: with nothing shared, the running layout's header is the pool's caption and the JSON's counts."""
    from engine.inspect.fragmentation import pool_caption
    from kvscope.sources.base import StepRecord
    from kvscope.sources.summary import Summary

    engine = tiny_engine(kv_layout="contiguous", max_model_len=32, enable_prefix_caching=False)
    engine.add_request(list(range(1, 11)), GREEDY, request_id="x")
    engine.add_request(list(range(20, 25)), GREEDY, request_id="y")
    engine.step()
    snap = engine.snapshot()
    contiguous, _ = layouts(snap, 32)
    c = pool_counts(snap)
    assert contiguous.counts() == {k: c[k] for k in ("used_slots", "wasted_slots", "reserved_slots")}
    assert (c["used_slots"], c["wasted_slots"], c["reserved_slots"]) == (15, 5, 44)  # 2 x 8 blocks of 4
    assert contiguous.header().startswith("15 used · 5 wasted (8%) · 44 reserved (69%) of 64 slots")
    assert "15 slots used, 5 wasted inside blocks, 44 in blocks reserved" in pool_caption(c, "contiguous", 32)
    summary = Summary(max_model_len=32)
    summary.add(StepRecord(snap.step, snap, [], None, 0.0))
    f = summary.as_dict()["fragmentation"]
    assert f["layouts"]["contiguous"] == contiguous.counts() and f["wasted_slots"] == 5


def test_the_comparison_replays_the_runs_own_prompts_not_engine_made_children(tiny_engine):
    engine = tiny_engine()
    engine.add_request([1, 2, 3, 4, 5], GREEDY, request_id="p")
    engine.step()
    engine.fork("p")
    h = RunHistory()
    while engine.has_unfinished():
        engine.step()
        h.record(engine.snapshot(), 0.01)
    prompts, max_tokens = comparison_prompts(h)
    assert prompts == ((1, 2, 3, 4, 5),) and max_tokens == GREEDY.max_tokens


def test_an_engine_made_request_is_said_to_be_its_parents_not_unadmitted(tiny_engine):
    from engine import SamplingParams
    from kvscope.diagnosis import Diagnosis

    e = tiny_engine(num_gpu_blocks=64, block_size=4)
    e.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=1), request_id="0")
    d = Diagnosis()
    for _ in range(2):
        out = e.step()
        snap = e.snapshot()
        d.feed(snap.step, list(out.events) + e.ledger.drain_events(), snap)
    child = next(r for r in snap.requests if r.request_id != "0" and r.request_id.startswith("0"))
    text = d.miss_text(snap, child.request_id)
    assert "has not been admitted" not in text and "a parallel sample of request 0" in text, text


def test_leaked_blocks_counts_leaks_only_and_a_replay_that_cannot_tell_says_so(tiny_engine):
    """Issue 34: a write into a shared block is flagged, but it is no leak."""
    from engine.inspect.audit import AuditProblem, AuditReport
    from kvscope.sources.base import StepRecord
    from kvscope.sources.replay import RecordedAudit
    from kvscope.sources.summary import Summary

    engine = tiny_engine()
    engine.add_request([1, 2, 3], GREEDY, request_id="x")
    engine.step()
    snap = engine.snapshot()
    report = AuditReport(
        (
            AuditProblem(3, "shared_write", 1, 2, "1, step 4: write into a block with ref count 2"),
            AuditProblem(5, "leaked", 0, 1, "2"),
            AuditProblem(6, "leaked", 0, 1, "2"),
        )
    )
    summary = Summary()
    summary.add(StepRecord(snap.step, snap, [], None, 0.0, report))
    out = summary.as_dict()
    assert (out["leaked_blocks"], out["flagged_blocks"]) == (2, 3)
    assert out["audit_blocks_by_kind"] == {"shared_write": 1, "leaked": 2}
    assert "tables hold" not in str(report.problems[0]) and "tables hold 0" in str(report.problems[1])
    summary.add(StepRecord(snap.step, snap, [], None, 0.0, RecordedAudit([3, 5])))  # a trace: no kinds
    assert (summary.as_dict()["leaked_blocks"], summary.as_dict()["flagged_blocks"]) == (None, 2)
    summary.add(StepRecord(snap.step, snap, [], None, 0.0, None))
    assert (summary.as_dict()["leaked_blocks"], summary.as_dict()["flagged_blocks"]) == (0, 0)
