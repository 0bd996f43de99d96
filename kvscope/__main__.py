"""``kvscope`` entry point: the window, ``--headless``, or ``--screenshot``."""
from __future__ import annotations

import logging
import os
import sys

from .cli import build_parser, engine_config

NO_DISPLAY = ("kvscope: no display found (DISPLAY/WAYLAND_DISPLAY unset). Run `kvscope --headless`, "
              "or `xvfb-run kvscope`, or set QT_QPA_PLATFORM=offscreen.")


def has_display() -> bool:
    if sys.platform != "linux":
        return True
    if os.environ.get("QT_QPA_PLATFORM", "").split(":")[0] in ("offscreen", "minimal", "vnc", "eglfs", "linuxfb"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from .sources.attach_trace import is_attach_trace
    if args.attach or (args.replay and is_attach_trace(args.replay)):
        if args.screenshot:
            os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        from .kv_events_cli import run_attach
        return run_attach(args)
    try:
        config = engine_config(args)
    except ValueError as e:
        print(f"kvscope: {e}", file=sys.stderr)
        return 2
    if args.headless:
        from .headless import run_headless
        return run_headless(config, args)
    if args.screenshot:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    elif not has_display():
        print(NO_DISPLAY, file=sys.stderr)
        return 2
    from .app import run_app
    return run_app(config, args)


if __name__ == "__main__":
    sys.exit(main())
