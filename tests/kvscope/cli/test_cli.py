"""The command line: help, no display, bad devices and settings, headless, the --screenshot mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def kvscope(*args: str, env_drop=(), timeout=300, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in env_drop}
    e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout
    )


def test_help_explains_every_engine_setting():
    out = kvscope("--help").stdout
    for opt in (
        "--block-size",
        "--num-gpu-blocks",
        "--kv-cache-memory-bytes",
        "--gpu-memory-utilization",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--no-prefix-caching",
        "--device",
        "--dtype",
        "--model",
        "--headless",
        "--screenshot",
    ):
        assert opt in out


def test_no_display_is_one_line_with_the_way_out():
    r = kvscope(env_drop=("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no display" in lines[0]
    assert "--headless" in lines[0] and "xvfb-run" in lines[0] and "QT_QPA_PLATFORM=offscreen" in lines[0]


def test_block_size_zero_is_refused():
    r = kvscope("--headless", "--block-size", "0")
    assert r.returncode == 2 and "block_size must be >= 1" in r.stderr


def test_cuda_without_cuda_is_one_clear_line():
    r = kvscope("--headless", "--device", "cuda", CUDA_VISIBLE_DEVICES="")  # hides any GPU
    assert r.returncode == 2  # a bad configuration (issue 12: it was 1)
    assert r.stderr.strip().splitlines()[-1].startswith("kvscope: --device cuda was asked for")


def test_unknown_model_is_one_clear_line():
    r = kvscope("--headless", "--model", "no-such-model-xyz")
    assert r.returncode == 2  # bad input
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvscope: cannot find model 'no-such-model-xyz'; tried:")


def test_headless_json_on_a_tiny_model(tiny_dir):
    ids = ",".join(map(str, range(1, 14)))
    r = kvscope(
        "--headless",
        "--json",
        "--model",
        tiny_dir,
        "--num-gpu-blocks",
        "32",
        "--block-size",
        "4",
        "--max-tokens",
        "5",
        "--inject-ids",
        ids,
        "--inject-ids",
        ids,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [q["prompt_tokens"] for q in out["requests"]] == [13, 13]
    assert [q["output_tokens"] for q in out["requests"]] == [5, 5]
    # the second, admitted in the same step, hits the first's three full blocks (the last token is computed)
    assert out["prefix_cache_hits"] == 12 and out["leaked_blocks"] == 0 and out["num_blocks"] == 32


def test_a_text_prompt_without_a_tokenizer_is_one_line(tiny_dir):
    r = kvscope(
        "--headless", "--json", "--model", tiny_dir, "--num-gpu-blocks", "32", "--block-size", "4", "--inject", "hello"
    )
    assert r.returncode == 2 and "no tokenizer" in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_screenshot_mode_on_the_embedded_model(tmp_path):
    path = tmp_path / "shots" / "today" / "window.png"  # folders that do not exist yet are made (docs/reliability)
    r = kvscope("--screenshot", str(path), "--steps", "4", "--num-gpu-blocks", "128", "--max-tokens", "8", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert path.stat().st_size > 20_000
    prompt = "The capital of France is Paris, and the capital of Italy is Rome; the capital of Spain is"
    r = kvscope(
        "--headless", "--json", "--num-gpu-blocks", "64", "--max-tokens", "6", "--inject", prompt, "--inject", prompt
    )
    summary = json.loads(r.stdout)
    full = (summary["requests"][0]["prompt_tokens"] - 1) // 16 * 16  # full blocks short of the last token
    assert full >= 16 and summary["prefix_cache_hits"] == full  # the second prompt hits every full block
    assert [q["output_tokens"] for q in summary["requests"]] == [6, 6]
    assert summary["leaked_blocks"] == 0


def test_attach_gets_the_checks_every_window_has(monkeypatch, capsys):
    """``--attach`` used to open its window before the Qt-library check that keeps Qt from aborting the process."""
    import kvscope.platform_check
    from kvscope.cli import main

    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setenv("DISPLAY", ":99")
    monkeypatch.setattr(kvscope.platform_check, "xcb_problem", lambda: "for the window, install: libxcb-cursor0")
    assert main(["--attach", "tcp://127.0.0.1:5999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvscope: for the window, install: libxcb-cursor0"]
    monkeypatch.delenv("DISPLAY")
    monkeypatch.delenv("QT_QPA_PLATFORM")
    assert main(["--attach", "tcp://127.0.0.1:5999"]) == 2
    assert "no display" in capsys.readouterr().err


def test_a_long_prefill_says_its_progress_headless(tiny_dir):
    """Headless prints the same progress line as the window's status bar, on stderr (stdout stays JSON)."""
    r = kvscope(
        "--headless",
        "--json",
        "--model",
        tiny_dir,
        "--num-gpu-blocks",
        "32",
        "--block-size",
        "4",
        "--max-num-batched-tokens",
        "8",
        "--inject-ids",
        ",".join(map(str, range(10, 30))),
        "--max-tokens",
        "2",
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "prefilling" in ln]
    assert lines == [
        "kvscope: step 1: prefilling request 0: 8 of 20 prompt tokens (40%)",
        "kvscope: step 2: prefilling request 0: 16 of 20 prompt tokens (80%)",
    ]
    json.loads(r.stdout)
