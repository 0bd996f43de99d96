"""``kvscope --attach ADDR`` (and ``--replay`` of an attach trace): another engine's KV events, headless or in a
window. The flags are ``cli.parser``'s; publishing kvscope's own events is ``runtime.build``'s.

The source is a ``Source`` like any other: headless, ``cli.headless.drive`` steps it (one step a poll) and
its ``PollSummary`` (the source's ``poll_summary``) is what is printed."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvscope.cli.headless import drive
from kvscope.sources.attached import AttachConfig, AttachedSource, AttachReplay
from kvscope.sources.poll_summary import PollSummary

log = logging.getLogger("kvscope.kv_events")


# --- attach ----------------------------------------------------------------------------------


def attach_config(args: argparse.Namespace) -> AttachConfig:
    if args.poll_interval <= 0:
        raise ValueError("--poll-interval must be > 0")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration must be > 0")
    for flag, value, default in (
        ("--bytes-per-block", args.bytes_per_block, None),
        ("--prefix-caching-hash-algo", args.prefix_caching_hash_algo, "auto"),
        ("--hash-seed", args.hash_seed, None),
    ):
        if value != default:
            raise ValueError(f"{flag} is for a fleet (several --attach, or --fleet FILE)")
    if len(args.replay_endpoint) > 1:
        raise ValueError(f"one --attach but {len(args.replay_endpoint)} --replay-endpoint")
    # In a window the timer polls every --poll-interval and a poll never waits: the GUI thread must not block.
    cfg = AttachConfig(
        endpoint=args.attach[0],
        replay_endpoint=args.replay_endpoint[0] if args.replay_endpoint else None,
        topic=args.kv_events_topic,
        dp_size=args.dp_size,
        block_size=args.block_size,
        max_nodes=args.max_blocks,
        poll_interval=args.poll_interval if args.headless else 0.0,
    )
    cfg.validate()
    return cfg


def open_attach_source(args: argparse.Namespace) -> AttachedSource | AttachReplay:
    """The live subscriber (``--attach``) or the replay of an attach trace (``--replay``)."""
    if args.attach:
        return AttachedSource(attach_config(args), trace_path=args.trace)
    return AttachReplay(args.replay)


def attach_summary_lines(out: dict) -> list[str]:
    """An attached source's ``PollSummary.as_dict()`` in text: the polls, the cache, the counters, the gaps and
    what was skipped."""
    c = out["counters"]
    lines = [
        f"attached to {', '.join(out['attached_to'])}: {out['polls']} polls in {out['seconds']} s",
        f"  cache: {out['blocks']} blocks, {out['tokens']} tokens, {out['roots']} prefix trees",
    ]
    lines += [f"    dp {t['dp_rank']} {t['medium']}: {t['blocks']} blocks, {t['tokens']} tokens" for t in out["tiers"]]
    lines.append(
        f"  {c['batches']} batches, {c['blocks_stored']} blocks stored ({out['rates']['stored_per_s']}/s), "
        f"{c['blocks_removed']} removed ({out['rates']['removed_per_s']}/s), {c['caches_cleared']} resets"
    )
    lines.append(
        f"  gaps: {c['gaps_detected']} detected, {c['gaps_repaired']} repaired, {c['gaps_unrepaired']} not "
        f"({c['batches_missing']} batches missing) · skipped: {c['malformed_messages']} malformed "
        f"messages, {c['unknown_event_kinds']} unknown events, {c['bad_events']} bad events"
    )
    return lines


def run_attach_headless(source: AttachedSource | AttachReplay, args: argparse.Namespace) -> int:
    """The one headless loop (``--steps`` polls, ``--duration`` seconds, or until Ctrl+C or the trace's end)."""
    summary = PollSummary(source)
    failed = drive(source, summary.add, args.steps, args.duration, until_interrupted=True)
    if failed is not None:
        return failed
    if summary.last is None:
        print("kvscope: nothing to show (the attach trace has no polls)", file=sys.stderr)
        return 2
    out = summary.as_dict()
    print(json.dumps(out, indent=2) if args.json else "\n".join(attach_summary_lines(out)))
    return 0


def run_attach(args: argparse.Namespace) -> int:
    """``kvscope --attach ...`` or ``kvscope --replay ATTACH_TRACE``: exit 2 with one line on bad input."""
    try:
        source = open_attach_source(args)
    except (ValueError, OSError) as e:
        print(f"kvscope: {e}", file=sys.stderr)
        return 2
    if args.headless:
        return run_attach_headless(source, args)
    from kvscope.cli.window import run_attach_window  # the display and Qt's libraries checked, as for any window

    return run_attach_window(source, args)
