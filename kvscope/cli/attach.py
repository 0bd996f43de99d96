"""``kvscope --attach ADDR`` (and ``--replay`` of an attach trace): another engine's KV events, headless or in a
window. The flags are ``cli.parser``'s; publishing kvscope's own events is ``runtime.build``'s."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from kvscope.sources.attach_trace import AttachTraceError
from kvscope.sources.attached import CANNOT_SHOW, AttachConfig, AttachedSource, AttachRecord, AttachReplay

log = logging.getLogger("kvscope.kv_events")


# --- attach ----------------------------------------------------------------------------------

def attach_config(args: argparse.Namespace) -> AttachConfig:
    # In a window the timer polls every --poll-interval and a poll never waits: the GUI thread must not block.
    cfg = AttachConfig(endpoint=args.attach, replay_endpoint=args.replay_endpoint, topic=args.kv_events_topic,
                       dp_size=args.dp_size, block_size=args.block_size, max_nodes=args.max_blocks,
                       poll_interval=args.poll_interval if args.headless else 0.0)
    cfg.validate()
    if args.poll_interval <= 0:
        raise ValueError("--poll-interval must be > 0")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration must be > 0")
    return cfg


def open_attach_source(args: argparse.Namespace) -> AttachedSource | AttachReplay:
    """The live subscriber (``--attach``) or the replay of an attach trace (``--replay``)."""
    if args.attach:
        return AttachedSource(attach_config(args), trace_path=args.trace)
    return AttachReplay(args.replay)


def attach_summary(source, last: AttachRecord, polls: int, seconds: float) -> dict:
    d = source.describe()
    s = last.summary
    c = last.counters
    return {
        "attached_to": d.get("endpoints", []), "replay_endpoints": d.get("replay_endpoints", []),
        "topic": d.get("topic", ""), "polls": polls, "seconds": round(seconds, 3),
        "blocks": s.blocks, "tokens": s.tokens, "roots": s.roots, "tiers": [t.as_dict() for t in s.tiers],
        "block_sizes": sorted(source.model.block_sizes),
        "rates": {"stored_per_s": round(c["blocks_stored"] / seconds, 3) if seconds > 0 else 0.0,
                  "removed_per_s": round(c["blocks_removed"] / seconds, 3) if seconds > 0 else 0.0,
                  "window_stored_per_s": round(last.rates["stored_per_s"], 3),
                  "window_removed_per_s": round(last.rates["removed_per_s"], 3)},
        "counters": c, "gaps_unrepaired": [g.as_dict() for g in last.gaps], "cannot_show": CANNOT_SHOW,
    }


def run_attach_headless(source, args: argparse.Namespace) -> int:
    polls, last, t0 = 0, None, time.monotonic()
    replay = isinstance(source, AttachReplay)
    try:
        while True:
            if args.steps is not None and polls >= args.steps:
                break
            if args.duration is not None and time.monotonic() - t0 >= args.duration:
                break
            if replay and not source.has_work():
                break
            last = source.poll(args.poll_interval)
            polls += 1
    except KeyboardInterrupt:
        pass
    except AttachTraceError as e:
        print(f"kvscope: {e}", file=sys.stderr)
        return 2
    finally:
        source.close()
    if last is None:
        print("kvscope: nothing to show (the attach trace has no polls)", file=sys.stderr)
        return 2
    seconds = last.t if replay else time.monotonic() - t0
    out = attach_summary(source, last, polls, seconds)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    c = out["counters"]
    print(f"attached to {', '.join(out['attached_to'])}: {polls} polls in {out['seconds']} s")
    print(f"  cache: {out['blocks']} blocks, {out['tokens']} tokens, {out['roots']} prefix trees")
    for t in out["tiers"]:
        print(f"    dp {t['dp_rank']} {t['medium']}: {t['blocks']} blocks, {t['tokens']} tokens")
    print(f"  {c['batches']} batches, {c['blocks_stored']} blocks stored ({out['rates']['stored_per_s']}/s), "
          f"{c['blocks_removed']} removed ({out['rates']['removed_per_s']}/s), {c['caches_cleared']} resets")
    print(f"  gaps: {c['gaps_detected']} detected, {c['gaps_repaired']} repaired, {c['gaps_unrepaired']} not "
          f"({c['batches_missing']} batches missing) · skipped: {c['malformed_messages']} malformed messages, "
          f"{c['unknown_event_kinds']} unknown events, {c['bad_events']} bad events")
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
