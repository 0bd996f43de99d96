"""``kvscope`` entry point: the window, ``--headless``, or ``--screenshot``.

Exit codes: 0 done; 2 bad input or configuration (flags, files, a missing display or system
library, a device that is not there), always with one line on stderr; 1 a run that failed; 130
interrupted (Ctrl+C).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from .cli import build_parser, engine_config

NO_DISPLAY = ("kvscope: no display found (DISPLAY/WAYLAND_DISPLAY unset). Run `kvscope --headless`, "
              "or `xvfb-run kvscope`, or set QT_QPA_PLATFORM=offscreen.")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def has_display() -> bool:
    if sys.platform != "linux":
        return True
    if os.environ.get("QT_QPA_PLATFORM", "").split(":")[0] in ("offscreen", "minimal", "vnc", "eglfs", "linuxfb"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def check_screenshot_path(path: str) -> None:
    """Refuse, before any model loads, a screenshot path that could never be written."""
    p = Path(path)
    if p.suffix.lower() not in IMAGE_SUFFIXES:
        raise ValueError(f"--screenshot {path}: the file must end in {', '.join(IMAGE_SUFFIXES)}")
    if p.is_dir():
        raise ValueError(f"--screenshot {path} is a directory")
    folder = p.parent
    while not folder.exists():  # the folders still to create: the nearest existing one must take them
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"--screenshot {path} cannot be written (no write permission in {folder})")


def check_files(args) -> None:
    """The files the arguments name, read (and refused with one line) before anything starts."""
    if getattr(args, "serve", False) and args.replay:
        raise ValueError("--serve needs a live engine: a --replay cannot serve requests")
    if getattr(args, "kv_events_endpoint", None) and args.replay:
        raise ValueError("--kv-events-endpoint publishes a live engine's events, not a trace replay")
    if args.replay:
        from engine.inspect.trace import read_header
        read_header(args.replay)
    elif args.scenario:
        from .scenario import load_scenario
        load_scenario(args.scenario)
    if args.screenshot:
        check_screenshot_path(args.screenshot)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad flag exits 2 with one line
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from .sources.attach_trace import is_attach_trace
    if args.attach or (args.replay and is_attach_trace(args.replay)):
        if args.screenshot:
            os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        from .kv_events_cli import run_attach
        return run_attach(args)
    try:
        config = engine_config(args)
        check_files(args)
    except ValueError as e:
        print(f"kvscope: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    if args.headless:
        from .headless import run_headless
        return run_headless(config, args)
    if args.screenshot:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    elif not has_display():
        print(NO_DISPLAY, file=sys.stderr)
        return 2
    from .platform_check import xcb_problem
    problem = xcb_problem()  # before QApplication: Qt aborts the process when the plugin cannot load
    if problem:
        print(f"kvscope: {problem}", file=sys.stderr)
        return 2
    early = spawn_early(config, args)
    from .app import run_app  # Qt and pyqtgraph: about a second, while the engine process starts
    return run_app(config, args, early)


def spawn_early(config, args):
    """The window's engine process, started before Qt is imported so that its start-up (torch, the
    weights) overlaps the window's; None where the engine runs elsewhere or serves."""
    if args.engine_thread or getattr(args, "serve", False):
        return None
    from .sources import protocol as p
    from .sources.build import SourceSpec
    from .sources.engine_process import spawn_engine
    return spawn_engine(SourceSpec.from_args(config, args), logging.getLogger().getEffectiveLevel(), p.Load(None))


if __name__ == "__main__":
    sys.exit(main())
