"""Every command the README, the docs and the scenarios' notes quote can be run as written: its flags parse, the
scenarios it names exist, the modules it runs with ``python -m`` are there. (A scenario's note once told students
to run ``python -m kvscope.compare_cli``, which did not exist.)"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shlex

import pytest

from kvscope.cli.checks import check_scenario_flags
from kvscope.cli.parser import engine_config, parse_args
from kvscope.scenario import ALIASES, available

ROOT = pathlib.Path(__file__).resolve().parents[1]


def quoted() -> list[tuple[str, str]]:
    """(where, command) for every `kvscope ...` or `python -m kvscope...` between backticks."""
    texts = [
        (str(p.relative_to(ROOT)), p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    ]
    for p in sorted((ROOT / "resources" / "scenarios").glob("*.json")):
        d = json.loads(p.read_text())
        texts.append(
            (
                str(p.relative_to(ROOT)),
                " ".join([d.get("description", ""), d.get("watch", "")] + [n["text"] for n in d.get("notes", [])]),
            )
        )
    out = []
    for where, text in texts:
        for m in re.finditer(r"`((?:python -m kvscope[\w.]*|kvscope)(?: [^`]*)?)`", text):
            out.append((where, m.group(1)))
    return out


COMMANDS = quoted()


def test_the_scenarios_quote_commands_and_the_docs_many():
    wheres = {w for w, _ in COMMANDS}
    assert any(w.startswith("resources/scenarios/") for w in wheres) and len(COMMANDS) > 20


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}: {c[:60]}" for w, c in COMMANDS])
def test_a_quoted_command_runs_as_written(where, command):
    words = shlex.split(command.replace("...", "").replace("…", ""))
    if words[:2] == ["python", "-m"]:
        assert importlib.util.find_spec(words[2]) is not None, f"{where}: no module {words[2]}"
        return
    args = [w for w in words[1:] if not (w.startswith("[") or w.endswith("]") or w in ("|",))]
    try:
        ns = parse_args(args)
    except SystemExit as e:
        if e.code == 0 and "--help" in args:
            return
        pytest.fail(f"{where}: `{command}` does not parse (exit {e.code})")
    # a placeholder (NAME, FILE) stands for any scenario; a name written out must be one
    if ns.scenario and not ns.scenario.endswith(".json") and not ns.scenario.isupper():
        assert ns.scenario in available() or ns.scenario in ALIASES, f"{where}: no scenario {ns.scenario!r}"
        check_scenario_flags(ns, engine_config(ns))  # a flag the scenario refuses, or --inject beside it
