"""The prefix cache's rules in one table (``engine.inspect.cache_rules``), and every copy of the cache made from
the event stream kept equal to the engine's own after every step: the pool's replay, the window's timeline,
the KV-event encoder read by a subscriber (vLLM's wire format), and the miss explainer."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.inspect.cache_miss import CacheMissExplainer
from engine.inspect.cache_rules import CACHE_CHANGES, CacheChange
from engine.inspect.events import EVENT_TYPES, BlockEvicted, BlockStored, BlockUnpublished, CacheReset
from engine.inspect.kv_events import external_hash, to_wire_events
from engine.inspect.kv_wire import decode_batch, encode_batch
from engine.inspect.replay import PoolReplayer
from kvscope.history import RunHistory
from kvscope.scenario import ScenarioRunner, available, load_scenario
from kvscope.sources.live import LiveSource
from kvscope.sources.remote_cache import RemoteCacheModel
from tests.checked import failing_execute
from tests.conftest import byte_tokenizer, make_tiny_hf


def test_the_table_names_every_event_that_changes_a_hash():
    assert CACHE_CHANGES == {
        BlockStored: CacheChange.STORED,
        BlockEvicted: CacheChange.EVICTED,
        BlockUnpublished: CacheChange.WITHDRAWN,
        CacheReset: CacheChange.CLEARED,
    }
    # every other kind of event leaves the cache alone (a new kind must be placed in the table or here)
    assert {c.kind for c in EVENT_TYPES.values()} - {c.kind for c in CACHE_CHANGES} == {
        "allocated",
        "hit",
        "freed",
        "cow",
        "swap_out",
        "swap_in",
        "admitted",
        "forked",
        "preempted",
        "finished",
        "aborted",
        "leak",
    }
    assert [c for c in CacheChange if c.removes] == [CacheChange.EVICTED, CacheChange.WITHDRAWN]


class Mirrors:
    """Every consumer of the stream, fed one step at a time, each asked for the cache it believes in."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.replay = PoolReplayer(engine.pool.num_blocks)
        self.history = RunHistory(keyframe_every=1)  # a keyframe every step: each takes the followed cache
        self.history.record(engine.snapshot(), 0.0)
        self.remote = RemoteCacheModel()
        self.explainer = CacheMissExplainer(engine.config.block_size)
        self.bs = engine.config.block_size

    def feed(self, step: int, events: list, snap) -> None:
        self.replay.apply_all(events, step)
        self.history.record(snap, 0.0, events=events)
        batch = decode_batch(encode_batch(to_wire_events(events, self.bs), 0.0))
        for ev in batch.events:
            self.remote.apply(ev, 0)
        self.explainer.feed_snapshot(step, events, snap)

    def check(self, step: int) -> None:
        pool = self.engine.pool
        truth = {b.block_id: b.block_hash.hex() for b in pool.cached.values()}  # the pool's own blocks
        assert dict(self.replay.hashes.items()) == truth, f"replay, step {step}"
        assert dict(self.replay.cached_tokens.items()) == {b.block_id: b.token_ids for b in pool.cached.values()}
        assert dict(self.history.at(step).block_hashes) == truth, f"timeline, step {step}"
        assert {h for (_, _, h) in self.remote.nodes} == {external_hash(h, "int") for h in truth.values()}, (
            f"subscriber, step {step}"
        )
        assert set(self.explainer.mirror) == set(truth.values()), f"miss explainer, step {step}"


def run_checked(source: LiveSource, steps: int) -> int:
    mirrors = Mirrors(source.engine)
    n = 0
    while source.has_work() and n < steps:
        rec = source.step()
        n += 1
        snap = source.engine.snapshot()
        mirrors.feed(rec.step, rec.events, snap)
        mirrors.check(rec.step)
    return n


@pytest.fixture(scope="module")
def tiny_long():
    # SmolLM2's vocabulary size: the labs name token ids of it; text is tokenized byte by byte
    return make_tiny_hf(max_position_embeddings=4096, vocab_size=49152), byte_tokenizer()


# a lab recorded from a real vLLM (probe_trace) runs no engine of kvscope's: tests/kvscope/sources/test_probe_lab.py
# feeds its events to the same consumers
ENGINE_SCENARIOS = [n for n in available() if not load_scenario(n).probe_trace]


@pytest.mark.parametrize("name", ENGINE_SCENARIOS)
def test_every_scenario_every_consumer_keeps_the_engines_cache(tiny_long, name):
    model, tok = tiny_long
    sc = load_scenario(name)
    engine = LLMEngine.from_hf_model(model, tok, EngineConfig(**sc.config), name="tiny")
    source = LiveSource(engine, ScenarioRunner(sc))
    assert run_checked(source, min(sc.steps or 120, 120)) > 0


def test_a_failed_steps_store_reaches_every_consumer_as_removed(tiny_long):
    """The bug the table fixes: a store rolled back when its step failed never reached KV-event subscribers."""
    model, _ = tiny_long
    engine = LLMEngine.from_hf_model(model, None, name="tiny", block_size=4, num_gpu_blocks=32)
    mirrors = Mirrors(engine)
    engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=4, temperature=0.0))
    real = engine.runner.execute
    engine.runner.execute = failing_execute(engine.runner)  # the first step (the prefill storing 2 blocks) fails
    out = engine.step()
    withdrawn = [e for e in out.events if isinstance(e, BlockUnpublished)]
    assert out.error and len(withdrawn) == 2
    wire = to_wire_events(out.events, 4)
    removed = [h for ev in wire if type(ev).__name__ == "WireRemoved" for h in ev.block_hashes]
    assert sorted(removed) == sorted(external_hash(e.block_hash, "int") for e in withdrawn)
    mirrors.feed(out.step, out.events, engine.snapshot())
    mirrors.check(out.step)
    assert not mirrors.remote.nodes  # the subscriber holds no prefix that does not exist
    engine.runner.execute = real
    engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        res = engine.step()
        mirrors.feed(res.step, res.events, engine.snapshot())
        mirrors.check(res.step)
    assert mirrors.remote.nodes  # stored again once a step succeeded
