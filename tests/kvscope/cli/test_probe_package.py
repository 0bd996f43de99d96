"""kvscope without its probe's package (``kvscope_vllm_probe``, which ``pip install .`` does not bring): everything
but a probed vLLM runs, and what needs the probe says in one line how to install it (exit 2).

Each run is a fresh Python whose import system refuses the package (a ``sys.meta_path`` blocker), as a machine
that never installed it would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
WITHOUT_PROBE = """
import runpy, sys

class NoProbe:
    def find_spec(self, name, path=None, target=None):
        if name == "kvscope_vllm_probe" or name.startswith("kvscope_vllm_probe."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoProbe())
for name in [m for m in sys.modules if m.startswith("kvscope_vllm_probe")]:
    del sys.modules[name]
sys.argv = ["kvscope", *sys.argv[1:]]
runpy.run_module("kvscope", run_name="__main__")
"""
INSTALL = "needs kvscope's probe package (kvscope-vllm-probe), not installed here: pip install ./probe"


def kvscope(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_PROBE, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_the_blocker_blocks():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_PROBE.replace('runpy.run_module("kvscope", run_name="__main__")', "") + "import kvscope_vllm_probe",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "No module named 'kvscope_vllm_probe'" in out.stderr


def test_help_runs_without_the_probe():
    out = kvscope("--help", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--probe ADDR" in out.stdout and "--probe-key FILE" in out.stdout


def test_a_headless_scenario_runs_without_the_probe():
    out = kvscope("--headless", "--json", "--scenario", "four-score", "--steps", "6")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["steps"] >= 6 and d["requests"] and d["audit_problems"] == []


@pytest.mark.parametrize(
    "argv, what",
    [
        (["--headless", "--probe", "tcp://127.0.0.1:5570"], "--probe"),
        (["--probe", "tcp://127.0.0.1:5570", "--probe-fault", "leak-last-block"], "--probe"),
        (["--headless", "--scenario", "lab-vllm-leak"], "--scenario lab-vllm-leak (a probed vLLM's recording)"),
        (
            ["--headless", "--replay", "resources/probe/vllm-leak.jsonl"],
            "--replay resources/probe/vllm-leak.jsonl (a probed vLLM's recording)",
        ),
    ],
)
def test_what_needs_the_probe_says_how_to_install_it(argv, what):
    out = kvscope(*argv, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"kvscope: {what} {INSTALL} from a kvscope checkout"]
