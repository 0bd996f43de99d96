"""``kvscope --workload FILE``: a request trace played without weights (``engine.workload``).

What the command line refuses for a workload, the same in the window and headless, and the headless
run: one run's ``workload`` object (``--json``) or lines, or a sweep of capacities with its table and
plot (``--sweep-kv-tokens``). ``python -m engine.workload`` prints the same through the same ``play``.
"""

from __future__ import annotations

import argparse
import sys

from engine import EngineConfig

# what a workload run cannot be combined with, and why (one line each)
CONFLICTS = (
    ("scenario", "--scenario"),
    ("replay", "--replay"),
    ("serve", "--serve"),
    ("inject", "--inject"),
    ("inject_ids", "--inject-ids"),
    ("compare_caching", "--compare-caching"),
    ("explain_block", "--explain-block"),
    ("trace", "--trace"),
    ("kv_events_endpoint", "--kv-events-endpoint"),
)


def check_workload(args: argparse.Namespace, config: EngineConfig) -> None:
    """Refuse, before anything starts, what a workload run cannot do, and a bad workload file (its
    first bad line, named by file and line). Raises ``ValueError`` with one line."""
    from kvscope.cli.parser import fleet_config, sim_config

    sim = sim_config(args)  # a --sim-* or fleet option without --workload is refused here too
    if not args.workload:
        return
    for dest, flag in CONFLICTS:
        if getattr(args, dest, None) not in (None, False, [], ""):
            raise ValueError(f"--workload plays a trace without weights: not with {flag}")
    if config.model is not None:
        raise ValueError(
            "--workload simulates a model without its weights: name it with --sim-model "
            f"(e.g. --sim-model llama-2-7b), not --model {config.model}"
        )
    from engine.workload.cli import check_sweeps, parse_floats
    from engine.workload.fleet_config import parse_instance_counts

    caps = parse_floats(args.sweep_kv_tokens) if args.sweep_kv_tokens else None
    counts = parse_instance_counts(args.sweep_instances) if args.sweep_instances else None
    check_sweeps(config, sim, fleet_config(args), caps, counts, args.png, window=not args.headless)
    if args.sweep_kv_tokens and not args.headless:
        raise ValueError("--sweep-kv-tokens runs many pools one after another: use it with --headless")
    if args.sequential and not args.headless:
        raise ValueError(
            "--sequential plays requests one at a time without arrivals: use it with --headless "
            "(the window plays the trace at its arrival times)"
        )
    if args.headless:
        return  # play() reads the file, and refuses a bad line, once
    # The window's engine process would say it only after Qt started: read it here (WorkloadError is a ValueError)
    from engine.workload.reader import read_workload

    read_workload(args.workload, tokenizer=_tokenizer(config), limit=args.limit)
    sim.cost_model(config)


def _tokenizer(config: EngineConfig):
    if not config.tokenizer:
        return None
    from engine.runner.models.loader import load_tokenizer

    return load_tokenizer(config.tokenizer)


def run_workload_headless(config: EngineConfig, args: argparse.Namespace) -> int:
    from engine.messages import one_line
    from engine.workload.cli import parse_floats, play
    from engine.workload.fleet_config import parse_instance_counts
    from kvscope.cli.parser import fleet_config, sim_config

    try:
        return play(
            args.workload,
            config,
            sim_config(args),
            [config.eviction_policy],
            parse_floats(args.sweep_kv_tokens) if args.sweep_kv_tokens else None,
            png=args.png,
            as_json=args.json,
            tokenizer=config.tokenizer,
            limit=args.limit,
            fleet=fleet_config(args),
            counts=parse_instance_counts(args.sweep_instances) if args.sweep_instances else None,
        )
    except (ValueError, OSError) as e:  # a WorkloadError is a ValueError
        print(f"kvscope: {one_line(e)}", file=sys.stderr)
        return 2
