"""Issue 34: an engine flag beside --scenario is applied over the scenario's setting or refused, in one place
(kvscope.scenario.scenario_config), never silently dropped; --inject beside a scenario is refused."""

from __future__ import annotations

import json

import pytest

from engine import EngineConfig
from kvscope.cli import main
from kvscope.cli.parser import engine_config, parse_args
from kvscope.scenario import REFUSED_OVER_SCENARIO, available, load_scenario, scenario_config

# two valid values for every setting a shipped scenario sets, one of them other than the scenario's (a new setting
# must be added here, and so decided)
OTHER = {
    "block_size": (8, 32),
    "num_gpu_blocks": (200, 201),
    "num_cpu_blocks": (3, 4),
    "max_model_len": (512, 1024),
    "kv_layout": ("paged", "contiguous"),
    "preemption_mode": ("swap", "recompute"),
    "fault": ("double-free", "cow-leak"),
}


def test_a_flag_is_given_even_at_its_default_and_an_alias_counts():
    assert parse_args(["--block-size", "16"]).engine_flags_given == {"block_size"}  # 16 is the default
    assert parse_args(["--no-prefix-caching"]).engine_flags_given == {"enable_prefix_caching"}
    assert parse_args(["--headless"]).engine_flags_given == frozenset()


@pytest.mark.parametrize("name", [n for n in available() if load_scenario(n).config])
def test_every_setting_a_scenario_sets_is_applied_or_refused(name):
    sc = load_scenario(name)
    for key, value in sc.config.items():
        assert key in OTHER, f"{name} sets {key}: decide in REFUSED_OVER_SCENARIO and add it to OTHER"
        other = next(v for v in OTHER[key] if v != value)
        args = parse_args([f"--{key.replace('_', '-')}", str(other), "--scenario", name])
        config = engine_config(args)
        if key in REFUSED_OVER_SCENARIO:
            with pytest.raises(ValueError, match=rf"^--{key.replace('_', '-')} is refused with --scenario {name}"):
                scenario_config(config, sc, args.engine_flags_given)
            continue
        merged, notices = scenario_config(config, sc, args.engine_flags_given)
        assert getattr(merged, key) == other  # the flag wins
        assert all(getattr(merged, k) == v for k, v in sc.config.items() if k != key)  # the rest is the scenario's
        assert notices == [
            f"--{key.replace('_', '-')} {other} applied over scenario {name}'s {key}={value!r} "
            f"(its notes describe {value!r})"
        ]


def test_without_flags_the_scenario_wins_as_before():
    sc = load_scenario("four-score")
    merged, notices = scenario_config(EngineConfig(), sc)
    assert (merged.block_size, merged.num_gpu_blocks, notices) == (4, 32, [])


def test_block_size_over_a_scenario_headless(capsys):
    """`--scenario shared-system-prompt --block-size 4` used to keep 16 tokens a block silently."""
    assert main(["--headless", "--json", "--scenario", "four-score", "--block-size", "8", "--steps", "1"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["block_size"] == 8
    assert "kvscope: --block-size 8 applied over scenario four-score's block_size=4 (its notes describe 4)" in cap.err


@pytest.mark.parametrize("mode", [["--headless"], ["--screenshot", "x.png"]])
@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["--scenario", "leak-hunt", "--fault", "shared-write"],
            "kvscope: --fault is refused with --scenario leak-hunt",
        ),
        (["--scenario", "four-score", "--inject", "hi"], "kvscope: --inject is refused with --scenario four-score"),
        (
            ["--scenario", "four-score", "--inject-ids", "1,2"],
            "kvscope: --inject-ids is refused with --scenario four-score",
        ),
    ],
)
def test_a_refusal_is_one_line_and_exit_2_headless_and_in_the_window(capsys, tmp_path, monkeypatch, mode, argv, line):
    monkeypatch.chdir(tmp_path)
    assert main(mode + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1


@pytest.mark.parametrize(
    "alias",
    [
        "two-requests",
        "sharing",
        "copy-on-write",
        "preemption",
        "one-request",
        "cow",
        "swap",
        "beams",
        "leak",
        "chat",
        "prefix-caching",
    ],
)
def test_a_teachers_name_is_an_alias_of_a_scenario(alias):
    from kvscope.scenario import ALIASES

    sc = load_scenario(alias)
    assert sc.name == ALIASES[alias] in available()  # the scenario's own name: notes, traces, the window's title


def test_list_scenarios_prints_every_scenario_with_its_aliases(capsys):
    assert main(["--list-scenarios"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" ")[0].rstrip(":") for ln in lines] == available()
    assert "four-score (also one-request, two-requests): " in "\n".join(lines)
    assert "parallel-sampling (also copy-on-write, cow): " in "\n".join(lines)
    assert "pool-exhaustion (also preemption, swap): " in "\n".join(lines)


def test_an_unknown_scenario_names_the_aliases_too(capsys):
    assert main(["--headless", "--scenario", "paging"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: unknown scenario 'paging'") and "two-requests" in err and err.count("\n") == 1
