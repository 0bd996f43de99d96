"""A block's life story (issue 15): it is exactly the events that name the block, its holders are the
requests whose tables map it, and for a leaked block it names the request that kept it."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.inspect.block_story import block_story, format_story
from engine.inspect.events import (
    BlockAllocated,
    BlockCopied,
    BlockEvicted,
    BlockFreed,
    BlockStored,
    BlockTouched,
    BlockUnpublished,
    LeakFound,
    RequestForked,
    SwappedIn,
    SwappedOut,
)
from kvscope.sources.live import LiveSource

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def names_block(e, b: int) -> bool:
    if isinstance(
        e, (BlockAllocated, BlockTouched, BlockFreed, BlockStored, BlockEvicted, BlockUnpublished, LeakFound)
    ):
        return e.block_id == b
    if isinstance(e, BlockCopied):
        return b in (e.src_block_id, e.dst_block_id)
    if isinstance(e, (SwappedOut, SwappedIn, RequestForked)):
        return b in e.block_ids
    return False


def run(source: LiveSource, prompts, params, steps: int):
    records = []
    for p in prompts:
        source.inject(p, params)
    records.append(source.current())
    for _ in range(steps):
        if not source.has_work():
            break
        records.append(source.step())
    return records


@pytest.fixture
def busy(tiny_hf):
    """Shared prefixes, a fork by n=2 (copy-on-write), evictions in a small pool, requests finishing."""
    engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=24)
    source = LiveSource(engine)
    prefix = list(range(10, 22))
    prompts = [prefix + [30 + i, 40 + i, 50 + i] for i in range(3)]
    records = run(source, prompts, GREEDY, 6)
    records += run(
        source, [prefix + [99]], SamplingParams(max_tokens=6, temperature=0.8, n=2, seed=3, ignore_eos=True), 40
    )
    for start in (60, 100, 140):  # distinct prompts: the free queue runs out of empty blocks and evicts
        records += run(source, [list(range(start, start + 20))], GREEDY, 40)
    yield source, records
    source.close()


def test_the_story_of_every_block_is_the_events_that_name_it_and_its_holders_map_it(busy):
    source, records = busy
    steps = [(r.step, r.events) for r in records]
    kinds = {e.kind for r in records for e in r.events}
    assert {"allocated", "hit", "freed", "stored", "cow", "evicted"} <= kinds, kinds
    last = records[-1].snapshot
    for b in range(source.info.num_blocks):
        lines = block_story(b, steps)
        from_story = [ln.event for ln in lines if ln.event is not None and names_block(ln.event, b)]
        assert from_story == [e for r in records for e in r.events if names_block(e, b)], b
        holders = lines[-1].holders if lines else ()
        assert sorted(holders) == sorted(last.owners_of(b)), (b, format_story(b, lines))
    # some block went the whole way: stored, freed by its last holder, and later handed out again
    assert any(
        {"stored", "freed", "evicted"} <= {ln.kind for ln in block_story(b, steps)}
        for b in range(source.info.num_blocks)
    )


def test_a_leaked_block_names_the_request_that_ended_without_releasing_it(tiny_hf):
    engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=24, fault="abort-leak")
    source = LiveSource(engine)
    records = run(source, [list(range(10, 19)), list(range(40, 47))], GREEDY, 2)
    victim = records[-1].snapshot.requests[0]
    source.abort(victim.request_id)
    records.append(source.current())
    records.append(source.step())  # the audit (on with any fault) reports the leak
    source.close()
    leaked = sorted({e.block_id for r in records for e in r.events if isinstance(e, LeakFound)})
    assert leaked and set(leaked) <= set(victim.block_ids)
    lines = block_story(leaked[0], [(r.step, r.events) for r in records])
    suspect = [ln for ln in lines if ln.kind == "suspect"]
    assert len(suspect) == 1 and f"request {victim.request_id} ended" in suspect[0].text
    assert "never released" in suspect[0].text and lines[-1].holders == (victim.request_id,)


def test_explain_block_headless_prints_the_story_and_refuses_a_bad_id(capsys, tiny_dir):
    from kvscope.cli import main

    base = [
        "--model",
        tiny_dir,
        "--headless",
        "--num-gpu-blocks",
        "16",
        "--block-size",
        "4",
        "--inject-ids",
        "1,2,3,4,5,6",
        "--max-tokens",
        "4",
    ]
    assert main(base + ["--explain-block", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("block 1:") and "allocated to request" in out and "stored in the prefix cache" in out
    assert main(base + ["--explain-block", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "kvscope: --explain-block 16: no such block (the pool has blocks 0-15)"
