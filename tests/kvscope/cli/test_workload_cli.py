"""``kvscope --workload FILE`` (issue 26): headless (one run's ``workload`` object, ``--sequential``, a sweep
with its table and plot), every refusal in one line with exit 2 (the same line with a window or without),
and the window's live source: the trace's arrivals fed step by step on the virtual clock, the same run
as headless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.workload import SimConfig, read_workload, run_workload
from engine.workload.cli import main as workload_main
from engine.workload.reference import prefix_sharing
from kvscope.cli import main
from kvscope.runtime.build import SourceSpec, build_source
from kvscope.sources.workload import WorkloadSource, WorkloadSpec

ROOT = Path(__file__).resolve().parents[3]
CONVERSATION = ROOT / "resources" / "workloads" / "mooncake_conversation_200.jsonl"
SYNTHETIC = ROOT / "resources" / "workloads" / "mooncake_synthetic_200.jsonl"
EXAMPLE = ROOT / "resources" / "workloads" / "example_kvscope.jsonl"
KEYS = {
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "hit_rate",
    "evictions",
    "preemptions",
    "ttft_p50_s",
    "ttft_p99_s",
}
COST_OF_THIS_MACHINE = {"wall_s", "peak_rss_mb"}


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_headless_json_prints_the_workload_object_as_python_m_engine_workload_does(capsys):
    flags = ["--block-size", "16", "--num-gpu-blocks", "600", "--limit", "40"]
    out = run_json(capsys, ["--headless", "--json", "--workload", str(CONVERSATION), *flags])["workload"]
    assert KEYS <= set(out)
    assert out["requests"] + out["skipped_too_big"] + out["skipped_too_long"] == 40
    assert out["hit_rate"] == out["cached_tokens"] / out["prompt_tokens"]
    assert out["evictions"] > 0  # 600 blocks of 16 are far smaller than 40 of these prompts
    assert workload_main([str(CONVERSATION), "--json", *flags]) == 0
    same = json.loads(capsys.readouterr().out)["workload"]
    assert {k: v for k, v in out.items() if k not in COST_OF_THIS_MACHINE} == {
        k: v for k, v in same.items() if k not in COST_OF_THIS_MACHINE
    }


def test_sequential_with_a_pool_that_never_evicts_reaches_the_traces_own_sharing(capsys):
    out = run_json(
        capsys,
        [
            "--headless",
            "--json",
            "--workload",
            str(CONVERSATION),
            "--block-size",
            "512",
            "--sequential",
            "--kv-tokens",
            "1e8",
            "--limit",
            "120",
        ],
    )["workload"]
    ref = prefix_sharing(read_workload(CONVERSATION, limit=120), 512)
    assert out["mode"] == "sequential" and out["evictions"] == 0
    assert out["cached_tokens"] == ref.cached_tokens and out["prompt_tokens"] == ref.prompt_tokens


def test_the_sweep_prints_its_table_and_draws_hit_rate_against_capacity(capsys, tmp_path):
    png = tmp_path / "sweep.png"
    assert (
        main(
            [
                "--headless",
                "--workload",
                str(CONVERSATION),
                "--block-size",
                "512",
                "--sequential",
                "--sweep-kv-tokens",
                "1e5,1e6,1e8",
                "--limit",
                "80",
                "--png",
                str(png),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ") and "lru" in line]
    assert len(rows) == 3  # one a capacity
    assert "reference (a pool that never evicts" in text and png.stat().st_size > 10_000
    assert (
        main(
            [
                "--headless",
                "--json",
                "--workload",
                str(CONVERSATION),
                "--block-size",
                "512",
                "--sequential",
                "--sweep-kv-tokens",
                "1e5,1e8",
                "--limit",
                "80",
                "--png",
                str(png),
                "--eviction-policy",
                "lfu",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    rates = [r["hit_rate"] for r in data["sweep"]]
    assert [r["policy"] for r in data["sweep"]] == ["lfu", "lfu"] and rates[0] <= rates[1]
    assert rates[1] == pytest.approx(data["reference"]["hit_rate"])  # 1e8 tokens never evict


BAD = [
    (["--sim-gpu", "h200"], "kvscope: --sim-gpu plays a workload: give --workload FILE too"),
    (["--sequential"], "kvscope: --sequential plays a workload: give --workload FILE too"),
    (
        ["--workload", "{bad}", "--scenario", "four-score"],
        "kvscope: --workload plays a trace without weights: not with --scenario",
    ),
    (
        ["--workload", "{bad}", "--model", "tinyllama"],
        "kvscope: --workload simulates a model without its weights: name it with --sim-model (e.g. --sim-model "
        "llama-2-7b), not --model tinyllama",
    ),
    (["--workload", "{bad}"], "kvscope: {bad}:2: timestamp 5 ms goes back in time"),
    (["--workload", "{missing}"], "kvscope: {missing}: cannot read it (No such file or directory)"),
    (
        ["--workload", str(EXAMPLE), "--sweep-kv-tokens", "1e4,lots"],
        "kvscope: --sweep-kv-tokens takes numbers separated by commas",
    ),
    # a fleet (issue 35)
    (["--instances", "4"], "kvscope: --instances plays a workload: give --workload FILE too"),
    (["--sweep-instances", "1,2"], "kvscope: --sweep-instances plays a workload: give --workload FILE too"),
    (
        ["--workload", str(EXAMPLE), "--router", "session"],
        "kvscope: --router is for a fleet: give --instances N (or --sweep-instances)",
    ),
    (["--workload", str(EXAMPLE), "--fleet-kv-tokens", "1e6"], "kvscope: --fleet-kv-tokens is for a fleet"),
    (
        ["--workload", str(EXAMPLE), "--instances", "2", "--router", "random"],
        "kvscope: --router takes round-robin, least-loaded, session, prefix-aware, prefix-load",
    ),
    (
        ["--workload", str(EXAMPLE), "--instances", "2", "--fleet-kv-tokens", "1e6", "--kv-tokens", "1e5"],
        "kvscope: --fleet-kv-tokens sizes the fleet's pools: leave out --kv-tokens",
    ),
    (
        ["--workload", str(EXAMPLE), "--instances", "2", "--sweep-instances", "1,2"],
        "kvscope: --sweep-instances sets the number of instances: leave out --instances",
    ),
    (
        ["--workload", str(EXAMPLE), "--instances", "2", "--sweep-kv-tokens", "1e5"],
        "kvscope: --sweep-kv-tokens sweeps one engine's pool: not with --instances or --sweep-instances",
    ),
    (["--workload", str(EXAMPLE), "--sweep-instances", "2,x"], "kvscope: --sweep-instances takes instance counts"),
    (["--workload", str(EXAMPLE), "--instances", "2", "--png", "x.png"], "kvscope: --png draws a sweep"),
    (["--workload", "{bad}", "--instances", "2"], "kvscope: {bad}:2: timestamp 5 ms goes back in time"),
]


@pytest.mark.parametrize(("argv", "line"), BAD)
def test_bad_input_is_one_line_and_exit_2_with_a_window_or_without(argv, line, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 10, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}\n'
        '{"timestamp": 5, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}\n'
    )
    names = {"bad": str(bad), "missing": str(tmp_path / "nope.jsonl")}
    argv = [a.format(**names) for a in argv]
    line = line.format(**names)
    seen = []
    for mode in (["--headless"], []):  # the window refuses before Qt starts: no display needed
        assert main(mode + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line), err
        seen.append(err[0])
    assert seen[0] == seen[1]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--sequential"], "use it with --headless"),
        (
            ["--sweep-instances", "1,2"],
            "kvscope: --sweep-instances runs many fleets one after another: use it with --headless",
        ),
        (
            ["--instances", "2", "--router", "round-robin,session"],
            "kvscope: the window plays one fleet: give --router one policy",
        ),
        (
            ["--instances", "17"],
            "kvscope: the window draws at most 16 pools side by side: use --headless for --instances 17",
        ),
    ],
)
def test_the_window_refuses_what_only_headless_does(argv, line, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a headless sweep draws its PNG beside the command
    assert main(["--workload", str(CONVERSATION), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert main(["--headless", "--workload", str(CONVERSATION), "--limit", "3", *argv]) == 0  # headless does it
    capsys.readouterr()
    if "--sweep-instances" in argv:
        assert (tmp_path / "mooncake_conversation_200_fleet.png").stat().st_size > 10_000


def test_a_bad_instance_count_is_argparses_one_line(capsys):
    for mode in (["--headless"], []):
        with pytest.raises(SystemExit) as e:
            main([*mode, "--workload", str(EXAMPLE), "--instances", "0"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["kvscope: argument --instances: instances must be >= 1, got 0 (see kvscope --help)"]


def test_headless_plays_a_fleet_as_python_m_engine_workload_does(capsys):
    flags = ["--block-size", "64", "--kv-tokens", "2e5", "--limit", "40", "--instances", "3", "--router", "prefix-load"]
    out = run_json(capsys, ["--headless", "--json", "--workload", str(CONVERSATION), *flags])["workload"]
    assert KEYS <= set(out) and len(out["instances"]) == 3 and out["router"]["name"] == "prefix-load"
    assert out["requests"] == sum(i["requests"] for i in out["instances"])
    assert workload_main([str(CONVERSATION), "--json", *flags]) == 0
    same = json.loads(capsys.readouterr().out)["workload"]
    assert {k: v for k, v in out.items() if k not in COST_OF_THIS_MACHINE} == {
        k: v for k, v in same.items() if k not in COST_OF_THIS_MACHINE
    }
    # and a fleet of one is the single engine's object, plus what a fleet adds
    one = run_json(
        capsys,
        [
            "--headless",
            "--json",
            "--workload",
            str(CONVERSATION),
            *flags[:6],
            "--instances",
            "1",
            "--router",
            "session",
        ],
    )["workload"]
    single = run_json(capsys, ["--headless", "--json", "--workload", str(CONVERSATION), *flags[:6]])["workload"]
    assert {
        k: v for k, v in one.items() if k not in COST_OF_THIS_MACHINE | {"router", "load_imbalance", "instances"}
    } == {k: v for k, v in single.items() if k not in COST_OF_THIS_MACHINE}


def test_headless_sweeps_the_fleets_size(capsys, tmp_path):
    png = tmp_path / "fleet.png"
    assert (
        main(
            [
                "--headless",
                "--workload",
                str(SYNTHETIC),
                "--block-size",
                "64",
                "--kv-tokens",
                "2e5",
                "--limit",
                "30",
                "--sweep-instances",
                "1,2,4",
                "--router",
                "round-robin,prefix-aware",
                "--png",
                str(png),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| mooncake_synthetic_200 |")]
    assert len(rows) == 6 and png.stat().st_size > 20_000 and f"plot: {png}" in text


# -- the window's source -----------------------------------------------------------------------------------
def workload_source(limit: int = 30, **kw) -> WorkloadSource:
    config = EngineConfig(block_size=16, num_gpu_blocks=kw.pop("num_gpu_blocks", 800))
    return build_source(SourceSpec(config, workload=WorkloadSpec(str(CONVERSATION), SimConfig(**kw), limit)))


def test_the_live_source_feeds_arrivals_on_the_virtual_clock_and_plays_the_headless_run():
    src = workload_source()
    assert isinstance(src, WorkloadSource) and src.info.extra["workload"] == "mooncake_conversation_200"
    assert src.info.device == "simulated h100" and "played at its arrival times" in src.info.watch
    assert src.info.num_blocks == 800
    arrivals = [r.arrival_s for r in src.feeder.workload.requests]
    seen_requests = []
    while src.has_work():
        clock = src.engine.runner.clock
        rec = src.step()
        # a record's seconds are the simulated card's: the clock's advance (an idle wait included)
        assert rec.seconds == pytest.approx(src.engine.runner.clock - clock)
        added = src.feeder.next
        assert all(a <= src.engine.runner.clock for a in arrivals[:added])  # nothing added before it arrives
        seen_requests.append(len(rec.snapshot.requests))
    assert src.feeder.next == 30 and max(seen_requests) > 1
    live = src.feeder.finish().summary()
    headless = run_workload(
        read_workload(CONVERSATION, limit=30), EngineConfig(block_size=16, num_gpu_blocks=800), SimConfig()
    ).summary()
    for k in ("requests", "prompt_tokens", "cached_tokens", "evictions", "preemptions", "steps", "virtual_s"):
        assert live[k] == headless[k], k


def test_the_live_source_refuses_what_a_simulated_model_cannot_do():
    src = workload_source(limit=3)
    src.step()
    with pytest.raises(ValueError, match="loaded its model by name"):
        src.compare_caching([[1, 2, 3]])


def test_the_window_plays_a_workload_at_max_speed(qtbot, tmp_path):
    from PySide6.QtCore import QSettings

    from kvscope.ui.main_window import MainWindow

    settings = QSettings(str(tmp_path / "k.ini"), QSettings.Format.IniFormat)
    win = MainWindow(lambda _s: workload_source(limit=12, time_scale=0.2), settings)
    qtbot.addWidget(win)
    win.show()
    win.start()
    qtbot.waitUntil(lambda: win.info is not None and win.latest is not None, timeout=20_000)
    win.run_at_max()
    assert win.speed.currentText() == "max"
    qtbot.waitUntil(lambda: not win.running and win.latest.step > 0, timeout=60_000)  # it stops at the trace's end
    win.flush()
    snap = win.latest.snapshot
    assert snap.counters["num_requests_running"] == 0 and snap.counters["num_requests_waiting"] == 0
    assert len(win.history.series["evictions_per_s"]) == len(win.history.steps)
    assert win.plots.curves["evictions_per_s"].getData()[0] is not None
    win.shutdown()


def test_a_screenshot_of_a_workload(tmp_path, capsys):
    png = tmp_path / "w.png"
    assert (
        main(
            [
                "--workload",
                str(CONVERSATION),
                "--limit",
                "20",
                "--screenshot",
                str(png),
                "--steps",
                "40",
                "--window-size",
                "1280x720",
            ]
        )
        == 0
    )
    assert png.stat().st_size > 20_000
