"""Issue 34: a lesson's note quotes the pool as the engine reports it at that step (the pool-exhausted lab's
"100% used" beside a status bar at 85%). Each number a note quotes about the pool is read back from the run."""

from __future__ import annotations

import re

import pytest

from kvscope.cli.parser import engine_config, parse_args, source_spec
from kvscope.runtime.build import build_source
from kvscope.scenario import load_scenario

USED = re.compile(r"(\d+) of (?:the )?(\d+) blocks(?! are free)")
FREE = re.compile(r"(\d+) of (\d+) blocks are free")
PERCENT_AT = re.compile(r"(\d+)% used at step (\d+)")
PERCENT_NOW = re.compile(r"reads (\d+)% used now")


def counters_at(name: str, steps: set[int]) -> dict[int, dict]:
    args = parse_args(["--headless", "--scenario", name])
    src = build_source(source_spec(engine_config(args), args))
    seen = {}
    try:
        while src.has_work() and len(seen) < len(steps):
            rec = src.step()
            if rec.step in steps:
                seen[rec.step] = dict(rec.snapshot.counters)
    finally:
        src.close()
    return seen


@pytest.mark.parametrize("name", ["lab-pool-exhausted", "leak-hunt"])
def test_the_pool_numbers_a_note_quotes_are_the_engines(name):
    notes = load_scenario(name).notes
    wanted = {at for at, _ in notes} | {int(m[2]) for _, t in notes for m in PERCENT_AT.finditer(t)}
    counters = counters_at(name, wanted)
    checked = 0
    for at, text in notes:
        c = counters[at]
        used = c["num_blocks"] - c["num_free_blocks"]
        for m in USED.finditer(text):
            assert (int(m[1]), int(m[2])) == (used, c["num_blocks"]), (at, text)
            checked += 1
        for m in FREE.finditer(text):
            assert (int(m[1]), int(m[2])) == (c["num_free_blocks"], c["num_blocks"]), (at, text)
            checked += 1
        for m in PERCENT_NOW.finditer(text):
            assert int(m[1]) == round(100 * c["kv_cache_usage_perc"]), (at, text)
            checked += 1
        for m in PERCENT_AT.finditer(text):
            assert int(m[1]) == round(100 * counters[int(m[2])]["kv_cache_usage_perc"]), (at, text)
            checked += 1
    assert checked >= 1  # the notes do quote the pool
