"""Each benchmark's --quick mode runs and writes results of the documented shape (not speed)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

SHAPES = {
    "throughput": ("rows", {"system", "tok_s", "paged_over_this", "peak_running", "seconds"}),
    "capacity": ("rows", {"layout", "peak_running", "mean_running", "waste", "hit_rate", "vs_contiguous"}),
    "prefix_caching": (
        "rows",
        {
            "caching",
            "ttft_p50_s",
            "ttft_p99_s",
            "sequential_req_s",
            "concurrent_out_tok_s",
            "shared_hit_rate",
            "chat_ttft_per_turn_s",
            "chat_hit_rate",
        },
    ),
    "block_size": ("rows", {"block_size", "out_tok_s", "waste", "hit_rate"}),
    "inspector_cost": ("rows", {"mode", "steps_s", "ms_per_step", "vs_bare"}),
    "scheduler_overhead": ("rows", {"running", "prefix_caching", "us_per_step", "us_per_request"}),
    "kv_quant": ("rows", {"kv_cache_dtype", "blocks", "tokens", "x_fp32", "x_16bit", "tok_s"}),
    "kv_events": ("rows", {"what", "value", "unit", "vs_bare"}),
    "replay_memory": ("rows", {"trace_mb", "steps", "replayed", "rss_growth_mb"}),
    "fleet": (
        "rows",
        {
            "trace_key",
            "rate",
            "capacity",
            "router",
            "instances",
            "hit_rate",
            "ttft_p50_s",
            "ttft_p99_s",
            "load_imbalance",
            "per_instance",
        },
    ),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_quick_benchmark_writes_its_results(name, tmp_path, monkeypatch):
    common = importlib.import_module("common")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    result = importlib.import_module(name).run(quick=True)
    data = json.loads((tmp_path / "quick" / f"{name}.json").read_text())
    assert (tmp_path / "quick" / f"{name}.png").stat().st_size > 1000
    key, fields = SHAPES[name]
    assert data["benchmark"] == name and data["quick"] is True and data["machine"]
    assert data[key] and all(fields <= set(row) for row in data[key])
    assert data[key] == json.loads(json.dumps(result[key]))
    if name == "capacity":  # the claims the README makes, checked on the small run too
        rows = {r["layout"]: r for r in data["rows"]}
        assert rows["paged"]["peak_running"] > rows["contiguous (2048 reserved)"]["peak_running"]
        assert rows["paged"]["waste"] < 0.04
    if name == "kv_quant":
        rows = {r["kv_cache_dtype"]: r for r in data["rows"]}
        assert rows["fp8"]["x_16bit"] == 2.0 and rows["int8"]["blocks"] > rows["auto"]["blocks"]
        assert all(len(rows[d]["kl_16"]) == 24 and "agree_64_24" in rows[d] for d in ("fp8", "int8", "int4"))
    if name == "inspector_cost":  # the GPU-size rows: every figure the README's table shows
        assert [r["blocks"] for r in data["scale"]] == [2_912, 65_536]
        assert all(
            {"snapshot_ms", "timeline_rss_mb", "timeline_mb_estimate", "scrub_ms", "scrub_max_ms", "record_ms"}
            <= set(r)
            for r in data["scale"]
        )
    if name == "replay_memory":  # every record replayed, in memory that does not grow with the trace
        (row,) = data["rows"]
        assert row["replayed"] == row["steps"] and row["trace_mb"] >= 1 and row["rss_growth_mb"] < 64
    if name == "fleet":  # the two checks against references hold on the small run too; every point is there
        assert data["reference"] and all(r["equal"] for r in data["reference"])
        assert {(r["trace"], r["router"]) for r in data["equality"] if r["equal"]} == {
            (t, p) for t in ("conversation", "synthetic") for p in data["routers"]
        }
        points = {(r["trace_key"], r["rate"], r["capacity"], r["router"], r["instances"]) for r in data["rows"]}
        assert len(points) == len(data["rows"]) == 2 * 3 * len(data["routers"]) * len(data["counts"])
        assert (tmp_path / "quick" / "fleet_total.png").stat().st_size > 1000
    if name == "scheduler_overhead":
        assert [r["running"] for r in data["rows"]] == [1, 64, 256, 1, 64, 256, 256]
        assert [r["outputs"] for r in data["rows"]] == ["final_only"] * 6 + ["cumulative"]
