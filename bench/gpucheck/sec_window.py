"""Section window: the real window, offscreen, on the card.

``kvscope --model <folder> --screenshot ...`` on the checkpoint folder of random Llama-2-7B weights that
section inspector wrote (made here if it has not): the window's process with its engine process on CUDA at
the pool's real size (``--gpu-memory-utilization`` 0.9), the demo's chats injected; then the classroom's
``--scenario shared-system-prompt`` (its own 96-block pool). The image's Python has no Qt: PySide6 and
pyqtgraph travel as wheels (``scripts/gpu_env.sh``); if Qt cannot start, the section says exactly why.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .sec_inspector import FOLDER
from .shared import ROOT, Ctx, Section, Table, make_folder


def shot(args: list[str], png: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "kvscope", *args, "--screenshot", str(png), "--window-size", "1600x1000"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, err = proc.returncode, (proc.stderr or "").strip()
    except subprocess.TimeoutExpired:
        rc, err = "timeout", f"no screenshot within {timeout:.0f} s"
    return {
        "command": "kvscope " + " ".join(args),
        "rc": rc,
        "png": png.name if png.exists() else None,
        "bytes": png.stat().st_size if png.exists() else 0,
        "stderr": err.splitlines()[-3:] if err else [],
    }


def run(ctx: Ctx, section: Section) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "from PySide6 import QtWidgets, QtGui; import pyqtgraph"], capture_output=True, text=True
    )
    if probe.returncode:
        section.error = "Qt cannot start here: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
        return
    folder = make_folder(
        ctx.big, ctx.dtype, ctx.device, FOLDER if not ctx.dry_run else Path("/tmp/kvscope-gpucheck-tiny")
    )
    device = ["--view", "plots"] + ([] if not ctx.dry_run else ["--device", "cpu", "--num-gpu-blocks", "256"])
    runs = [
        shot(
            ["--model", str(folder), *device, "--max-model-len", "2048", "--steps", str(ctx.n(40, 6))],
            ctx.out / "gpu-window.png",
            min(ctx.left_s() - 25, 120),
        )
    ]
    if ctx.left_s() > 40:
        runs.append(
            shot(
                ["--model", str(folder), *device, "--scenario", "shared-system-prompt", "--steps", str(ctx.n(20, 4))],
                ctx.out / "gpu-window-scenario.png",
                ctx.left_s() - 5,
            )
        )
    section.tables.append(
        Table(
            "Screenshots",
            [("command", "command", ""), ("rc", "exit", ""), ("png", "image", ""), ("bytes", "bytes", ",d")],
            runs,
        )
    )
    for r in runs:
        if r["stderr"]:
            section.notes.append(f"`{r['command']}` said: " + " | ".join(r["stderr"]))
    section.check(
        "the window on the card: exit code, image written",
        f"{runs[0]['rc']}, {runs[0]['bytes']:,} bytes",
        "0, an image",
        runs[0]["rc"] == 0 and runs[0]["bytes"] > 10_000,
    )
    section.data["runs"] = runs
