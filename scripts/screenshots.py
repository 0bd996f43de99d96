"""Regenerate every picture the README and docs/ show, from the command quoted under it (so a caption's
command and its picture cannot part), and the same windows at 1280x720 for a look at projector size.

    .venv/bin/python scripts/screenshots.py              # docs/*.png as the docs say
    .venv/bin/python scripts/screenshots.py --small DIR  # also each window at 1280x720 into DIR
    .venv/bin/python scripts/screenshots.py --size 1600x1000 --into DIR  # each at that size into DIR, for a look
    .venv/bin/python scripts/screenshots.py --only cow   # the pictures whose name contains "cow"
    .venv/bin/python scripts/screenshots.py --display    # each in a real X window (Xvfb, Qt's xcb), as a user's

A screenshot takes the path a window takes: it selects nothing of its own (the window follows the lesson's
subject, else the newest running request; ``--select`` in a command is the user's choice, as a click is).

Runs offscreen (QT_QPA_PLATFORM=offscreen), or with ``--display`` in a window on a virtual X screen of its own
(Xvfb at 96 dpi, as the real-window tests use: a window a user sees, its picture taken by the same command), one
command at a time; exits 1 if any command failed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

ROOT = pathlib.Path(__file__).resolve().parents[1]


def quoted_shots() -> dict[str, list[str]]:
    """{docs/NAME.png: argv} for every `kvscope ... --screenshot docs/NAME.png ...` in the README and docs."""
    shots: dict[str, list[str]] = {}
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(
            r"`((?:python -m kvscope[\w.]*|kvscope) [^`]*--screenshot\s+docs/[\w-]+\.png[^`]*)`", p.read_text()
        ):
            words = shlex.split(m.group(1).replace("\n", " "))
            path = words[words.index("--screenshot") + 1]
            if words[0] == "kvscope":
                words = [sys.executable, "-m", "kvscope", *words[1:]]
            else:
                words = [sys.executable, *words[1:]]
            shots.setdefault(path, words)
    return shots


@contextmanager
def x_screen(size: str = "1920x1200"):
    """A virtual X screen (Xvfb) on a free display for as long as the block lasts: {DISPLAY, QT_QPA_PLATFORM}."""
    if shutil.which("Xvfb") is None:
        sys.exit("screenshots: --display needs Xvfb (bash scripts/setup_display.sh)")
    for n in range(150 + os.getpid() % 300, 500):
        if pathlib.Path(f"/tmp/.X{n}-lock").exists():
            continue
        cmd = ["Xvfb", f":{n}", "-screen", "0", f"{size}x24", "-dpi", "96", "-nolisten", "tcp", "-noreset", "-r"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        if proc.poll() is None:
            break
    else:
        sys.exit("screenshots: could not start Xvfb")
    try:
        yield {"DISPLAY": f":{n}", "QT_QPA_PLATFORM": "xcb"}
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", metavar="DIR", help="also save each window at 1280x720 into DIR")
    ap.add_argument("--only", default="", help="only pictures whose name contains this")
    ap.add_argument("--size", metavar="WxH", help="with --into: each window at this size instead of the docs'")
    ap.add_argument("--into", metavar="DIR", help="with --size: save there, not over docs/")
    ap.add_argument("--display", action="store_true", help="take each in a real X window (Xvfb), not offscreen")
    args = ap.parse_args()
    if bool(args.size) != bool(args.into):
        ap.error("--size and --into go together")
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    if not args.display:
        return take(args, env)
    with x_screen() as display, tempfile.TemporaryDirectory() as config:
        env.pop("QT_QPA_PLATFORM_PLUGIN_PATH", None)
        return take(args, {**env, **display, "XDG_CONFIG_HOME": config})


def take(args, env: dict[str, str]) -> int:
    failed = []
    for path, argv in quoted_shots().items():
        if args.only not in path:
            continue
        runs = [(path, argv)]
        if args.into:  # another size, into another folder: a look, the docs untouched
            out = str(pathlib.Path(args.into) / pathlib.Path(path).name)
            argv = [out if w == path else w for w in argv]
            if "--window-size" in argv:
                argv[argv.index("--window-size") + 1] = args.size
            else:
                argv += ["--window-size", args.size]
            runs = [(out, argv)]
        elif args.small and "--window-size" not in argv:
            small = str(pathlib.Path(args.small) / pathlib.Path(path).name)
            runs.append(
                (small, [*argv[: argv.index(path)], small, *argv[argv.index(path) + 1 :], "--window-size", "1280x720"])
            )
        for out, cmd in runs:
            print(f"{out}: {shlex.join(cmd[2:] if cmd[1] == '-m' else cmd[1:])}", flush=True)
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                failed.append(out)
                print(f"  failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
