"""``python -m kvscope.cli.demo attach|fleet``: the attach or fleet window over kvscope engines in this process
(``kvscope.runtime.demo``), for when no vLLM is at hand; the docs' attach and fleet pictures are taken with it."""

from __future__ import annotations

import argparse
import sys

from engine.config_options import OneLineParser
from kvscope.cli.arg_types import font_scale, positive_int, window_size


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m kvscope.cli.demo", description=__doc__.splitlines()[0])
    p.add_argument("window", choices=("attach", "fleet"), help="which window")
    p.add_argument(
        "--demo-blocks",
        type=positive_int,
        default=None,
        help="each engine's pool, in blocks (small: they evict; default 40 for attach, 16 for fleet)",
    )
    p.add_argument("--screenshot", metavar="FILE", help="save a PNG after --steps polls and exit")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N")
    p.add_argument("--window-size", type=window_size, default=None, metavar="WxH", help="e.g. 1280x720")
    p.add_argument("--font-scale", type=font_scale, default=None, metavar="X", help="every view's text, 1.0 to 2.0")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from kvscope.cli.checks import window_problem

    args.present = False
    problem = window_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from kvscope.runtime.demo import attach_demo, fleet_demo
    from kvscope.ui.host import HostOptions
    from kvscope.ui.windows import run_attach, run_fleet

    opts = HostOptions(args.screenshot, args.window_size, args.font_scale)
    if args.window == "attach":
        demo = attach_demo(args.demo_blocks or 40)
        try:
            return run_attach(demo.source, opts, 0.05, args.steps, demo.decode, demo.before_step)
        finally:
            demo.close()
    demo = fleet_demo(args.demo_blocks or 16, args.steps)
    try:
        return run_fleet(
            demo.source,
            opts,
            0.05,
            args.steps,
            tokenize=demo.tokenize,
            decode=demo.decode,
            route=demo.route,
            before_step=demo.before_step,
        )
    finally:
        demo.close()


if __name__ == "__main__":
    sys.exit(main())
