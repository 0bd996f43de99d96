"""The GPU acceptance run's rehearsal (``scripts/gpu_check.sh --dry-run``): every section end to end on tiny
shapes on the CPU, so a device call starts with a script that has already run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_dry_run_runs_every_section(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "work")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    sections = {s["name"]: s for s in report["sections"]}
    from bench.gpucheck.__main__ import NAMES

    assert list(sections) == NAMES
    failed = {n: s["verdict"] for n, s in sections.items() if s["verdict"].startswith("FAIL")}
    assert not failed, (failed, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 0
    md = (tmp_path / "gpu_report.md").read_text()
    assert all(f"## {n}:" in md for n in NAMES)
    # what a device call brings back: at most 8 files (the report, its logs packed, the screenshots)
    assert len([p for p in tmp_path.iterdir() if p.is_file()]) <= 8
    assert (tmp_path / "gpu-window.png").stat().st_size > 10_000
    # the rehearsal ran the engine on the Triton backend with the fused kernels (under the interpreter)
    decode = sections["decode"]["data"]["decode"]
    assert {r["variant"] for r in decode} == {"graphs + fused kernels", "graphs, ops unfused", "eager, ops unfused"}


def test_an_unknown_section_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpucheck", "--only", "decode,nope", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "nope" in proc.stderr
