"""Scenarios run headless; traces replay every step's snapshot exactly; bad traces give one line."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.inspect.trace import TraceError, replay_trace
from kvscope.scenario import ScenarioRunner, available, load_scenario
from kvscope.sources.live import LiveSource
from kvscope.sources.replay import ReplaySource
from kvscope.sources.summary import Summary
from tests.kvscope.cli.test_cli import kvscope

SCENARIOS = [
    "shared-system-prompt",
    "multi-turn-chat",
    "parallel-sampling",
    "pool-exhaustion",
    "leak-hunt",
    "four-score",
    "beam-search",
]


def assert_same_snapshot(a, b):
    for f in ("state", "ref_cnt", "owner", "has_hash", "last_access", "filled", "free_queue", "cpu_state", "cpu_owner"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.requests == b.requests
    assert a.cached_tokens == b.cached_tokens and a.block_hashes == b.block_hashes
    assert a.counters == b.counters and a.step == b.step


def test_every_documented_scenario_exists():
    assert set(SCENARIOS) <= set(available())
    with pytest.raises(ValueError, match="unknown scenario 'nope'; available: beam-search, four-score"):
        load_scenario("nope")


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_runs_headless_on_smollm2(smollm2, name, tmp_path):
    model, tok, src = smollm2
    sc = load_scenario(name)
    engine = LLMEngine.from_hf_model(model, tok, EngineConfig(**sc.config), name=src.name)
    session = LiveSource(engine, ScenarioRunner(sc), trace_path=str(tmp_path / "run.trace"))
    summary = Summary()
    summary.add(session.current())
    live = {}
    while session.has_work() and session.step_count < (sc.steps or 400):
        rec = session.step()
        summary.add(rec)
        live[rec.step] = rec.snapshot
    session.close()
    out = summary.as_dict()
    if name == "shared-system-prompt":
        assert out["prefix_cache_hits"] >= 5 * 48  # at least 3 shared blocks per later request
    if name == "multi-turn-chat":
        cached = [r["cached_tokens"] for r in out["requests"]]
        assert len(cached) == 4 and cached == sorted(cached) and cached[-1] > cached[0]
    if name in ("parallel-sampling", "beam-search"):
        assert out["cow_copies"] >= 1
    if name == "four-score":  # the paper's figure 5: two requests' blocks interleave in one pool
        assert any(
            s.block_tables.get("0") and s.block_tables.get("1") and min(s.block_tables["1"]) < max(s.block_tables["0"])
            for s in live.values()
        )
    if name == "beam-search":
        assert any(r["status"] == "finished_pruned" for r in out["requests"])
        assert session.current().snapshot.counters["num_free_blocks"] == engine.pool.num_blocks
    if name == "pool-exhaustion":
        assert out["swap_outs"] > 0 and out["num_preemptions"] > out["swap_outs"]  # some fell back
    if name == "leak-hunt":
        assert out["leaked_blocks"] > 0
        assert {r["status"] for r in out["requests"]} >= {"finished_aborted"}
    else:
        assert out["leaked_blocks"] == 0 and engine.audit().ok
    # The trace replays to the same snapshot at every step.
    replayed = {}
    for rec in replay_trace(tmp_path / "run.trace"):
        replayed[rec.step] = rec.snapshot
    for step, snap in live.items():
        assert_same_snapshot(replayed[step], snap)


def test_trace_replay_is_exact_under_pressure(tiny_hf, tmp_path):
    """CoW, swap, recompute, aborts and forks, all in one trace."""
    engine = LLMEngine.from_hf_model(
        tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=8
    )
    session = LiveSource(engine, trace_path=str(tmp_path / "t.trace"))
    rng = random.Random(2)
    live = {0: session.current().snapshot}
    for _ in range(120):
        if rng.random() < 0.5:
            session.inject(
                [rng.randrange(256) for _ in range(rng.randrange(2, 20))],
                SamplingParams(
                    n=rng.choice([1, 2]),
                    max_tokens=rng.randrange(8, 24),
                    temperature=1.0,
                    seed=rng.randrange(100),
                    ignore_eos=True,
                ),
            )
            live[session.step_count] = session.current().snapshot
        if engine.requests and rng.random() < 0.05:
            session.abort(rng.choice(sorted(engine.requests)))
            live[session.step_count] = session.current().snapshot
        rec = session.step()
        live[rec.step] = rec.snapshot
    session.close()
    kinds = {e.kind for r in replay_trace(tmp_path / "t.trace") for e in r.events}
    assert {"cow", "swap_out", "swap_in", "preempted", "forked"} <= kinds
    seen = {r.step: r.snapshot for r in replay_trace(tmp_path / "t.trace")}  # the last record of each step
    assert seen.keys() == live.keys()
    for step in live:
        assert_same_snapshot(seen[step], live[step])
    rs = ReplaySource(str(tmp_path / "t.trace"))
    steps = []
    while rs.has_work():
        steps.append(rs.step().step)
    assert steps == sorted(live)
    with pytest.raises(ValueError, match="read-only"):
        rs.inject("x", SamplingParams())


def test_a_trace_torn_by_a_crash_stays_readable(tiny_hf, tmp_path):
    engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=20)
    session = LiveSource(engine, trace_path=str(tmp_path / "t.trace"))
    session.inject([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(4):
        session.step()
    session.close()
    text = (tmp_path / "t.trace").read_text()
    (tmp_path / "torn.trace").write_text(text[:-25])  # the last line cut mid-way
    assert [r.step for r in replay_trace(tmp_path / "torn.trace")][-1] == 3


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "not a kvscope trace"),
        ("hello world\n", "not a kvscope trace"),
        ('{"some": "json"}\n', "not a kvscope trace"),
        ('{"format": "kvscope-trace", "version": 99, "num_blocks": 4, "block_size": 4}\n', "newer kvscope"),
        (
            '{"format": "kvscope-trace", "version": -1, "num_blocks": 4, "block_size": 4}\n',
            "version -1 is not a version",
        ),
        ('{"format": "kvscope-trace", "version": "1", "num_blocks": 4, "block_size": 4}\n', "is not a version"),
        ('{"format": "kvscope-trace", "num_blocks": 4, "block_size": 4}\n', "version None is not a version"),
        (
            '{"format": "kvscope-trace", "version": 1, "num_blocks": 4, "block_size": 4}\n{"step": 1, "events": [{"kind'
            '": "bogus"}], "requests": [], "shown": [], "counters": {}}\n{"step": 2}\n',
            "corrupt trace .* at line 2",
        ),
    ],
)
def test_bad_traces_give_one_clear_line(tmp_path, content, message):
    p = tmp_path / "bad.trace"
    p.write_text(content)
    with pytest.raises(TraceError, match=message):
        list(replay_trace(p))
    r = kvscope("--headless", "--replay", str(p))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvscope: ")


def test_replay_json_summary_equals_the_recorded_runs(tiny_dir, tmp_path):
    trace = tmp_path / "run.trace"
    common = [
        "--headless",
        "--json",
        "--model",
        tiny_dir,
        "--block-size",
        "4",
        "--num-gpu-blocks",
        "12",
        "--scenario",
        str(tmp_path / "sc.json"),
    ]
    (tmp_path / "sc.json").write_text(
        json.dumps(
            {
                "config": {"preemption_mode": "swap", "num_cpu_blocks": 4},
                "requests": [
                    {"at": i, "prompt": list(range(1 + i, 12 + i)), "max_tokens": 20, "ignore_eos": True}
                    for i in range(4)
                ],
            }
        )
    )
    live = kvscope(*common, "--trace", str(trace))
    assert live.returncode == 0, live.stderr[-1500:]
    replay = kvscope("--headless", "--json", "--replay", str(trace))
    assert replay.returncode == 0, replay.stderr[-1500:]
    a, b = json.loads(live.stdout), json.loads(replay.stdout)
    # the machine's free memory is read where the summary is printed, not recorded: it is not the run's
    assert a.pop("device_free_bytes") > 0 and b.pop("device_free_bytes") > 0
    assert a == b
    assert a["num_preemptions"] > 0 and all(r["ttft_s"] > 0 for r in a["requests"])  # recorded timings


def test_unknown_scenario_on_the_command_line():
    r = kvscope("--headless", "--scenario", "nope")
    assert r.returncode == 2 and "unknown scenario 'nope'" in r.stderr


def test_every_trace_kvscope_writes_kvscope_replays(tiny_dir, tmp_path):
    """Swap preemption on a small model used to record the default 4 GiB CPU pool (1.4 M blocks of 3 KiB), which
    the replay refused: the default CPU pool holds what every sequence at full length could swap, no more."""
    trace = tmp_path / "swap.trace"
    r = kvscope(
        "--headless",
        "--model",
        tiny_dir,
        "--preemption-mode",
        "swap",
        "--num-gpu-blocks",
        "24",
        "--block-size",
        "4",
        "--inject-ids",
        ",".join(map(str, range(1, 14))),
        "--inject-ids",
        ",".join(map(str, range(5, 15))),
        "--max-tokens",
        "40",
        "--steps",
        "30",
        "--trace",
        str(trace),
    )
    assert r.returncode == 0, r.stderr
    header = json.loads(trace.read_text().splitlines()[0])
    assert 0 < header["num_cpu_blocks"] <= header["config"]["max_num_seqs"] * 512 // 4
    replayed = kvscope("--headless", "--replay", str(trace))
    assert replayed.returncode == 0, replayed.stderr


def test_a_pool_no_replay_could_rebuild_is_refused_before_the_trace_is_written(tiny_dir, tmp_path):
    trace = tmp_path / "big.trace"
    r = kvscope(
        "--headless",
        "--model",
        tiny_dir,
        "--preemption-mode",
        "swap",
        "--num-cpu-blocks",
        str(2**21),
        "--steps",
        "1",
        "--trace",
        str(trace),
    )
    assert r.returncode == 2 and not trace.exists()
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("kvscope:")]  # the model's load logs above it
    assert (
        len(said) == 1
        and "kvscope: cannot record a trace: num_cpu_blocks = 2,097,152, above the replay limit" in said[0]
    )


def test_a_scenario_names_the_plot_its_lesson_reads(tmp_path):
    from kvscope.scenario import PLOTTED, load_scenario

    assert load_scenario("lab-pool-exhausted").plot == "pool_bytes" and "ttft" in PLOTTED
    bad = tmp_path / "bad.json"
    bad.write_text('{"title": "t", "view": "figure", "plot": "ttft", "requests": [{"prompt": "a"}]}')
    with pytest.raises(ValueError, match="'plot' names a series of the Plots tab"):
        load_scenario(str(bad))
