"""``kvscope`` with a window: the engine process started first (its start-up overlaps Qt's), then the window."""

from __future__ import annotations

import argparse
import logging
import sys

from engine import EngineConfig
from engine.inspect.trace import count_steps
from engine.messages import one_line
from kvscope.cli.checks import window_problem
from kvscope.cli.parser import serve_options, source_spec, window_limits
from kvscope.stopping import signals_held


def run_window(config: EngineConfig, args: argparse.Namespace) -> int:
    if args.serve and (args.replay or args.screenshot):
        print("kvscope: --serve needs a live engine in a window: not with --replay or --screenshot", file=sys.stderr)
        return 2
    problem = window_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.workload and args.instances is not None:
        return run_sim_fleet_window(config, args)
    welcome = args.view == "welcome"
    if welcome and (args.scenario or args.replay or args.inject or args.inject_ids or args.steps):
        print(
            "kvscope: --view welcome is the first screen, before any request: not with --scenario, --replay, "
            "--inject or --steps",
            file=sys.stderr,
        )
        return 2
    early = spawn_early(config, args)
    with signals_held():  # Qt and pyqtgraph: ~a second, while the engine starts; a signal waits for the import
        from kvscope.ui.app import WindowOptions, run_app

    own = args.scenario or args.replay or args.workload or args.probe or welcome  # a run with requests of its own
    prompts = args.inject + args.inject_ids or (demo_prompts() if args.screenshot and not own else [])
    opts = WindowOptions(
        source_spec(config, args),
        serve_options(args) if args.serve else None,
        args.engine_thread,
        args.screenshot,
        args.window_size,
        0 if welcome else args.steps or 8,
        tuple(prompts),
        args.max_tokens,
        count_steps(args.replay) if args.replay else None,
        tuple(x.strip() for x in (args.select or "").split(",") if x.strip()),
        args.select_block,
        args.compare,
        args.view,
        args.audit,
        args.font_scale,
        window_limits(args),
        args.present,
        bool(args.steps),
    )
    return run_app(opts, early)


def presentation_refused(args: argparse.Namespace, window: str) -> str | None:
    """Presentation shows a lesson, and only the main window has lessons: one line for the other kinds."""
    if args.present:
        return f"kvscope: --present shows a lesson in the main window: not with {window}"
    return None


def run_sim_fleet_window(config: EngineConfig, args: argparse.Namespace) -> int:
    """``kvscope --workload FILE --instances N``: the fleet's pools side by side, played on the GUI thread."""
    refused = presentation_refused(args, "--instances (a simulated fleet's window)") or steps_problem(
        args, "--instances (a simulated fleet)"
    )
    if refused:
        print(refused, file=sys.stderr)
        return 2
    from kvscope.cli.parser import fleet_config, sim_config
    from kvscope.sources.fleet_sim import SimFleetSpec, build_sim_fleet_source

    try:
        source = build_sim_fleet_source(
            SimFleetSpec(args.workload, sim_config(args), fleet_config(args), args.limit), config
        )
    except ValueError as e:
        print(f"kvscope: {one_line(e)}", file=sys.stderr)
        return 2
    with signals_held():
        from kvscope.ui.windows import run_sim_fleet

    return run_sim_fleet(source, host_options(args), args.steps)


def host_options(args: argparse.Namespace):
    """What every window kind takes from the command line (``ui.host.HostOptions``)."""
    from kvscope.ui.host import HostOptions

    return HostOptions(args.screenshot, args.window_size, args.font_scale, args.present)


def demo_prompts() -> list:
    """A screenshot of the plain model shows four chats sharing a system prompt (prefix hits to see)."""
    from kvscope.presets import shared_system_prompt

    return [shared_system_prompt(i) for i in range(4)]


def steps_problem(args: argparse.Namespace, what: str) -> str | None:
    """``--steps N`` in a window whose driver polls on its own (an attached engine, a fleet, a simulated fleet):
    refused in one line, never ignored; with ``--screenshot`` it counts the polls before the picture."""
    if args.steps and not args.screenshot:
        return (
            f"kvscope: --steps {args.steps} with {what} in a window: it polls on its own and takes no steps "
            "(--steps counts its polls with --screenshot)"
        )
    return None


def run_attach_window(source, args: argparse.Namespace) -> int:
    """``kvscope --attach ADDR``: the same display checks as every other window."""
    problem = (
        window_problem(args)
        or presentation_refused(args, "--attach (the attach window)")
        or steps_problem(args, "--attach")
    )
    if problem:
        source.close()
        print(problem, file=sys.stderr)
        return 2
    with signals_held():
        from kvscope.ui.windows import run_attach

    return run_attach(source, host_options(args), args.poll_interval, args.steps)


def run_fleet_window(
    source, args: argparse.Namespace, tokenizer, tokenizer_error: str | None, route: str | list[int] | None
) -> int:
    """``kvscope --fleet FILE`` or several ``--attach``: the same display checks as every other window. The prompt
    box tokenizes with ``tokenizer`` (None: it takes token ids, and ``tokenizer_error`` says why)."""
    problem = (
        window_problem(args)
        or presentation_refused(args, "a fleet (the fleet window)")
        or steps_problem(args, "--fleet")
    )
    if problem:
        source.close()
        print(problem, file=sys.stderr)
        return 2
    with signals_held():
        from kvscope.ui.windows import run_fleet

    tokenize = (lambda text: list(tokenizer.encode(text))) if tokenizer is not None else None
    return run_fleet(
        source,
        host_options(args),
        args.poll_interval,
        args.steps,
        tokenize=tokenize,
        decode=tokenizer.decode if tokenizer else None,
        tokenizer_error=tokenizer_error,
        route=route,
    )


def spawn_early(config: EngineConfig, args: argparse.Namespace):
    """The window's engine process, started before Qt is imported so that its start-up (torch, the
    weights) overlaps the window's; None where the engine runs elsewhere or serves."""
    if args.engine_thread or getattr(args, "serve", False):
        return None
    from kvscope.runtime import protocol as p
    from kvscope.runtime.engine_process import spawn_engine

    return spawn_engine(source_spec(config, args), logging.getLogger().getEffectiveLevel(), p.Load(None))
