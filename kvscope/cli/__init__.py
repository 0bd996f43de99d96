"""``kvscope``'s command line: parse, refuse bad input with one line, and start one mode.

Exit codes: 0 done; 2 bad input or configuration (flags, files, a missing display or system library, a
device that is not there), always with one line on stderr; 1 a run that failed; 130 interrupted (Ctrl+C).
The modes: the window (``cli.window``), ``--headless`` (``cli.headless``), ``--headless --serve``
(``cli.serve``), ``--workload`` (``cli.workload``; the window plays it live), ``--attach`` to another
engine's KV events (``cli.attach``), a fleet of them (``--fleet`` or several ``--attach``: ``cli.fleet``).
"""

from __future__ import annotations

import logging
import sys

from engine.messages import one_line


def main(argv: list[str] | None = None) -> int:
    from kvscope.cli.parser import engine_config, parse_args

    args = parse_args(argv)  # a bad flag exits 2 with one line
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.list_scenarios:
        from kvscope.scenario import scenario_listing

        print(scenario_listing())
        return 0
    from kvscope.cli.fleet import is_fleet

    if is_fleet(args):
        from kvscope.cli.fleet import run_fleet

        return run_fleet(args)
    from kvscope.sources.attach_trace import is_attach_trace

    if args.attach or (args.replay and is_attach_trace(args.replay)):
        from kvscope.cli.attach import run_attach

        return run_attach(args)
    from kvscope.cli.checks import check_files, check_scenario_flags
    from kvscope.cli.workload import check_workload

    try:
        config = engine_config(args)
        check_workload(args, config)
        check_files(args)
        for notice in check_scenario_flags(args, config):  # a flag applied over a scenario's setting, said
            print(f"kvscope: {notice}", file=sys.stderr)
    except ValueError as e:
        print(f"kvscope: {one_line(e)}", file=sys.stderr)
        return 2
    if args.workload and args.headless:
        from kvscope.cli.workload import run_workload_headless

        return run_workload_headless(config, args)
    if args.headless and args.serve:
        from kvscope.cli.serve import serve_headless

        return serve_headless(config, args)
    if args.headless:
        from kvscope.cli.headless import run_headless

        return run_headless(config, args)
    from kvscope.cli.window import run_window

    return run_window(config, args)
