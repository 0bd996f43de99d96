"""Start-up: a scenario over the same model reuses the weights in memory; the load reports its stages."""

from __future__ import annotations

from engine import EngineConfig, SamplingParams
from engine.runner.models import loader
from kvscope.runtime import build
from kvscope.runtime import protocol as p
from kvscope.runtime.build import SourceSpec
from kvscope.runtime.host import EngineHost

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_a_scenario_over_the_same_model_reuses_the_weights(tiny_dir, monkeypatch, tmp_path):
    scenario = tmp_path / "ids.json"
    scenario.write_text('{"config": {"block_size": 8, "num_gpu_blocks": 20}, "requests": [{"prompt": [1, 2, 3]}]}')
    monkeypatch.setattr(build, "_last_weights", None)
    loads = []
    real = loader.load_model
    monkeypatch.setattr("engine.llm_engine.load_model", lambda *a, **k: (loads.append(a[0]), real(*a, **k))[1])
    spec = SourceSpec(EngineConfig(model=tiny_dir, num_gpu_blocks=32, block_size=4))
    first = spec.factory(None)
    first.inject([5, 6, 7, 8], GREEDY)
    while first.has_work():
        first.step()
    expected = first.engine.snapshot().requests[0].token_ids
    second = spec.factory(str(scenario))  # another block size and pool: a new engine, the same weights
    assert len(loads) == 1 and second.engine.runner.model is first.engine.runner.model
    assert second.engine.config.block_size == 8 and second.engine.pool.num_blocks == 20
    third = spec.factory(None)
    third.inject([5, 6, 7, 8], GREEDY)
    while third.has_work():
        third.step()
    assert third.engine.snapshot().requests[0].token_ids == expected  # the reused weights are unchanged
    other = SourceSpec(EngineConfig(model=tiny_dir, dtype="float64", num_gpu_blocks=32)).factory(None)
    assert len(loads) == 2 and other.engine.runner.model is not first.engine.runner.model


def test_the_load_reports_what_it_is_doing_and_how_far(tiny_dir, monkeypatch):
    monkeypatch.setattr(build, "_last_weights", None)
    results = []
    spec = SourceSpec(EngineConfig(model=tiny_dir, num_gpu_blocks=32, block_size=4))
    host = EngineHost(spec.factory, results.append)
    host.handle(p.Load(None))
    stages = [(r.text, r.fraction) for r in results if isinstance(r, p.Progress)]
    fractions = [f for _, f in stages if f is not None]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert any("KV pool" in t for t, _ in stages) and any("reading" in t for t, _ in stages)
    assert isinstance(results[-2], p.Loaded) or any(isinstance(r, p.Loaded) for r in results)
    host.handle(p.Shutdown())
