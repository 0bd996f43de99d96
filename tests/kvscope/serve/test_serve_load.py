"""The short serving load test (the full one is ``python bench/serve_load.py``): see bench/serve_load.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from serve_load import run  # noqa: E402

import common  # noqa: E402


def test_quick_serving_load_with_disconnects_loses_and_leaks_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    [row] = run(quick=True)["rows"]
    assert row["errors"] == row["lost"] == row["doubled"] == row["wrong_outputs"] == 0
    assert row["leaked_blocks"] == 0 and row["audit_ok"] and row["requests_left_in_engine"] == 0
    assert row["left"] > 0 and row["aborts"] > 0 and row["max_abort_delay_steps"] <= 1
    assert row["stayed"] + row["left"] == row["requests"] == 40
    data = json.loads((tmp_path / "quick" / "serve_load.json").read_text())
    assert data["benchmark"] == "serve_load" and data["rows"] == json.loads(json.dumps([row]))
    assert {"req_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s"} <= set(row)
