"""An in-place write into a shared block (issue 15's planted fault) is caught twice: by running the same
requests with prefix caching on and off, and by the audit's write rule; the rule never fires on clean runs."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.inspect.compare import compare_caching
from kvscope.sources.live import LiveSource

A = list(range(10, 22))  # 3 blocks of 4
PROMPTS = [A, A[:8] + [90, 91, 92, 93], A]  # the second and third hit A's cached blocks


def engines(tiny_hf, fault=None):
    def make(caching: bool) -> LLMEngine:
        return LLMEngine.from_hf_model(
            tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=32, enable_prefix_caching=caching, fault=fault
        )

    return make


def test_caching_on_and_off_agree_token_for_token_without_the_fault(tiny_hf):
    c = compare_caching(engines(tiny_hf), PROMPTS, max_tokens=12)
    assert c.divergence is None and c.outputs_on == c.outputs_off and c.audit == "audit clean"


def test_the_comparison_and_the_audit_find_the_in_place_shared_write(tiny_hf):
    c = compare_caching(engines(tiny_hf, "shared-write"), PROMPTS, max_tokens=12)
    d = c.divergence
    assert d is not None, "the fault went unnoticed"
    assert d.request_index == 1 and d.num_cached_tokens == 8  # the first request that hit the cache
    assert d.with_caching[: d.token_index] == d.without_caching[: d.token_index]
    assert d.with_caching[d.token_index] != d.without_caching[d.token_index]
    assert "shared_write" in c.audit and f"request {d.request_id}" in c.audit


def test_the_divergence_reads_as_text_and_says_whose_blocks_it_names(tiny_hf):
    """A person reads the parting outputs as words, and the block ids are said to be the comparison's."""
    said = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731 - a tokenizer stand-in
    c = compare_caching(engines(tiny_hf, "shared-write"), PROMPTS, max_tokens=12, decode=said)
    d = c.divergence
    t = d.token_index
    assert d.with_text == said(list(d.with_caching[t : t + 8]))
    assert d.without_text == said(list(d.without_caching[t : t + 8]))
    line = c.summary()
    assert repr(d.with_text) in line and repr(d.without_text) in line
    assert "comparison's own caching engine" in line and "\n" not in str(d)
    assert d.to_dict()["with_caching_text"] == d.with_text


def test_the_write_audit_names_the_block_and_the_request(tiny_hf):
    engine = engines(tiny_hf, "shared-write")(True)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = engine.add_request(A, greedy)
    while engine.has_unfinished():
        engine.step()
    shared = engine.pool.cached  # A's full blocks are published
    second = engine.add_request(A[:8] + [90, 91, 92, 93], greedy)
    engine.step()
    report = engine.audit()
    bad = [p for p in report.problems if p.problem == "shared_write"]
    assert len(bad) == 1 and second in bad[0].last_owner and first != second
    assert bad[0].block_id in {b.block_id for b in shared.values()}


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_the_write_rule_never_fires_on_a_clean_busy_run(tiny_hf, preemption_mode):
    """Forks (copy-on-write), prefix hits, chunked prefill and preemption: every write is legal."""
    engine = LLMEngine.from_hf_model(
        tiny_hf,
        None,
        name="tiny",
        block_size=4,
        num_gpu_blocks=20,
        max_num_batched_tokens=16,
        preemption_mode=preemption_mode,
    )
    source = LiveSource(engine, audit=True)
    prefix = list(range(30, 42))
    for i in range(6):
        n = 2 if i % 3 == 0 else 1
        source.inject(
            prefix + [50 + i] * (i + 1), SamplingParams(max_tokens=10, n=n, temperature=0.7, seed=i, ignore_eos=True)
        )
    steps = 0
    kinds = set()
    while source.has_work() and steps < 200:
        rec = source.step()
        steps += 1
        kinds |= {e.kind for e in rec.events}
        assert rec.audit is not None and rec.audit.ok, rec.audit
    source.close()
    assert {"cow", "hit", "preempted"} <= kinds, kinds


def test_the_fault_shifts_only_a_first_chunk_starting_on_a_cached_block_boundary(tiny_hf):
    """What the fault is: a request's first chunk after a prefix hit that ends on a block boundary has its
    slots one too early; nothing else moves. And the fault switches the write audit on."""
    engine = engines(tiny_hf, "shared-write")(True)
    assert EngineConfig(fault="shared-write").fault == "shared-write" and engine.runner.write_observer is not None
    shifted: list[list[str]] = []
    real = engine.runner.execute

    def spy(sched):
        hit = engine.runner._shared_write_fault(sched)
        shifted.append([s.request.request_id for i, s in enumerate(sched.scheduled) if i in hit])
        return real(sched)

    engine.runner.execute = spy
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request(A, greedy)
    while engine.has_unfinished():
        engine.step()
    assert all(s == [] for s in shifted)  # no hit, no shift
    second = engine.add_request(A[:8] + [90, 91, 92, 93], greedy)  # hits 8 tokens: 2 blocks, a boundary
    engine.step()
    assert shifted[-1] == [second]
    engine.step()  # its decode steps are not shifted
    assert shifted[-1] == []


def test_headless_compare_caching_reports_the_divergence_and_a_clean_run(capsys, tiny_dir):
    import json

    from kvscope.cli import main

    base = [
        "--model",
        tiny_dir,
        "--headless",
        "--json",
        "--compare-caching",
        "--num-gpu-blocks",
        "32",
        "--block-size",
        "4",
        "--max-tokens",
        "8",
        "--inject-ids",
        ",".join(map(str, A)),
        "--inject-ids",
        ",".join(map(str, PROMPTS[1])),
    ]
    assert main(base) == 0
    clean = json.loads(capsys.readouterr().out)
    assert clean["divergence"] is None and clean["audit"] == "audit clean"
    assert main(base + ["--fault", "shared-write"]) == 0
    bad = json.loads(capsys.readouterr().out)
    assert bad["divergence"]["request_index"] == 1 and bad["divergence"]["num_cached_tokens"] == 8
    assert "shared_write" in bad["audit"]
