"""What the command line refuses before anything starts, each with one line: files, paths, a missing display.

One place for the window's and headless's refusals, so the same input gets the same line and exit code
(2) whichever mode reads it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvscope.cli.parser import probe_keys
from kvscope.sources.probe_package import require_probe

NO_DISPLAY = (
    "kvscope: no display found (DISPLAY/WAYLAND_DISPLAY unset). Run `kvscope --headless`, "
    "or `xvfb-run kvscope`, or set QT_QPA_PLATFORM=offscreen."
)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def has_display() -> bool:
    if sys.platform != "linux":
        return True
    if os.environ.get("QT_QPA_PLATFORM", "").split(":")[0] in ("offscreen", "minimal", "vnc", "eglfs", "linuxfb"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def window_problem(args: argparse.Namespace) -> str | None:
    """Why no window can open here (one line, the ``kvscope:`` prefix included), or None. A screenshot needs no
    display: it draws offscreen. Checked before Qt is imported, which aborts the process when it cannot start."""
    if args.screenshot:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    elif not has_display():
        return NO_DISPLAY
    from kvscope.platform_check import xcb_problem

    problem = xcb_problem()
    return f"kvscope: {problem}" if problem else None


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


_NOT_WITH_PROBE = (
    ("scenario", "--scenario"),
    ("replay", "--replay"),
    ("workload", "--workload"),
    ("serve", "--serve"),
    ("inject", "--inject"),
    ("inject_ids", "--inject-ids"),
    ("kv_events_endpoint", "--kv-events-endpoint"),
    ("compare_caching", "--compare-caching"),
)


def check_probe(args: argparse.Namespace) -> None:
    """``--probe`` shows a vLLM that runs elsewhere: nothing that needs kvscope's own engine goes with it; it
    needs the probe's package, and its keys, if given, must be readable certificates."""
    if not getattr(args, "probe", None):
        for name in ("probe_fault", "probe_key", "probe_server_key"):
            flag = "--" + name.replace("_", "-")
            if getattr(args, name, None):
                raise ValueError(f"{flag} is for a probed vLLM: it needs --probe ADDR")
        return
    if not args.probe.startswith(("tcp://", "ipc://")):
        raise ValueError(f"--probe {args.probe}: give the probe's ZeroMQ address, e.g. tcp://127.0.0.1:5570")
    for name, flag in _NOT_WITH_PROBE:
        if getattr(args, name, None):
            raise ValueError(f"--probe shows a running vLLM: not with {flag} (those run kvscope's own engine)")
    require_probe("--probe")
    from kvscope_vllm_probe.endpoints import check_endpoint
    from kvscope_vllm_probe.security import client_keys

    try:
        check_endpoint(args.probe)
    except ValueError as e:
        raise ValueError(f"--probe {e}") from None
    key, server = probe_keys(args)
    if bool(key) != bool(server):
        raise ValueError(
            "--probe-key and --probe-server-key go together: kvscope's secret certificate and the probe's public one"
        )
    if key:
        client_keys(key, server)  # readable, and the right kinds


def check_files(args: argparse.Namespace) -> None:
    """The files the arguments name, read (and refused with one line) before anything starts."""
    if getattr(args, "serve", False) and args.replay:
        raise ValueError("--serve needs a live engine: a --replay cannot serve requests")
    if getattr(args, "kv_events_endpoint", None) and args.replay:
        raise ValueError("--kv-events-endpoint publishes a live engine's events, not a trace replay")
    check_probe(args)
    if args.replay:
        from kvscope.sources.probe_trace import is_probe_trace

        if is_probe_trace(args.replay):  # a probe trace is read whole by its replay
            require_probe(f"--replay {args.replay} (a probed vLLM's recording)")
        else:
            from engine.inspect.trace import read_header

            read_header(args.replay)
    elif args.scenario:
        from kvscope.scenario import load_scenario

        sc = load_scenario(args.scenario)
        if sc.probe_trace:
            require_probe(f"--scenario {sc.name} (a probed vLLM's recording)")
    if args.screenshot:
        check_screenshot_path(args.screenshot)


def check_scenario_flags(args: argparse.Namespace, config) -> list[str]:
    """With ``--scenario``: the engine flags applied over its settings (a line each), or a refusal (``ValueError``);
    ``--inject`` is refused beside it: the scenario's notes number its own requests from 0, and a prompt injected
    first would take request 0 (``--compare-caching`` runs them after the scenario's: allowed)."""
    if not args.scenario or getattr(args, "replay", None):
        return []
    from kvscope.scenario import load_scenario, scenario_config

    sc = load_scenario(args.scenario)
    if (args.inject or args.inject_ids) and not getattr(args, "compare_caching", False):
        flag = "--inject" if args.inject else "--inject-ids"
        raise ValueError(
            f"{flag} is refused with --scenario {sc.name}: its notes number its own requests from 0 and "
            f"yours would come first (run the scenario, then inject from the window; or {flag} alone)"
        )
    if sc.probe_trace:
        return []
    return scenario_config(config, sc, getattr(args, "engine_flags_given", frozenset()))[1]
