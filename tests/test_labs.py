"""The diagnosis labs (issue 15) run headless on the embedded model and their JSON shows the cause."""
from __future__ import annotations

import json

from kvscope.__main__ import main


def headless_json(capsys, *argv: str) -> dict:
    assert main(["--headless", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_lab_low_hit_rate_names_each_cause(capsys):
    out = headless_json(capsys, "--scenario", "lab-low-hit-rate")
    miss = {r["request_id"]: r["prefix_cache_miss"] for r in out["requests"]}
    cached = {r["request_id"]: r["cached_tokens"] for r in out["requests"]}
    assert miss["0"]["reason"] == "no_cached_block"
    assert miss["1"]["reason"] == "differs_at" and cached["1"] == 64
    assert "09:00:0|7" in miss["1"]["detail"] and "09:00:0|1" in miss["1"]["detail"]  # the timestamp
    assert miss["2"]["reason"] == "different_tokenization" and cached["2"] == 0
    assert (miss["3"]["reason"], miss["3"]["token_position"], cached["3"]) == ("differs_at", 0, 0)
    assert miss["4"]["reason"] == "prompt_ends_in_block" and cached["4"] == 80


def test_lab_caching_changes_output_is_found_by_the_audit_and_the_comparison(capsys):
    out = headless_json(capsys, "--scenario", "lab-caching-changes-output")
    assert any("shared_write" in p for p in out["audit_problems"]), out["audit_problems"]
    cmp = headless_json(capsys, "--scenario", "lab-caching-changes-output", "--compare-caching")
    d = cmp["divergence"]
    assert d is not None and d["request_index"] == 1 and d["num_cached_tokens"] > 0
    assert "shared_write" in cmp["audit"]
    clean = headless_json(capsys, "--scenario", "shared-system-prompt", "--compare-caching")
    assert clean["divergence"] is None and clean["audit"] == "audit clean"
