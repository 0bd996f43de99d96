"""KV events on the command line: publish a session's events, or attach to a running engine.

``add_kv_events_args(parser)`` adds every option; ``open_publisher(args, block_size)`` and
``attach_publisher(session, pub)`` hook a publisher onto a session; ``run_attach(args)`` is
``kvscope --attach`` (and ``--replay`` of an attach trace), headless or in a window.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from engine.inspect.kv_events import HASH_FORMATS, WIRE_FORMATS, KVEventPublisher, KVEventsConfig

from .sources.attach_trace import AttachTraceError
from .sources.attached import CANNOT_SHOW, AttachConfig, AttachedSource, AttachRecord, AttachReplay

log = logging.getLogger("kvscope.kv_events")


def add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("KV events (vLLM's wire format: publish, or attach to vLLM / SGLang)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ADDR",
                   help="publish every step's block stores, evictions and cache resets on this ZeroMQ PUB "
                        "address, e.g. tcp://127.0.0.1:5557 (kvscope binds it)")
    p.add_argument("--kv-events-replay-endpoint", default=None, metavar="ADDR",
                   help="with --kv-events-endpoint: answer replay requests here, e.g. tcp://127.0.0.1:5558")
    p.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="topic of published batches; with --attach, the subscription prefix")
    p.add_argument("--kv-events-format", default="array", choices=WIRE_FORMATS,
                   help="events as positional arrays (vLLM's example subscriber, SGLang, vLLM up to 0.20) "
                        "or as maps with a 'type' key (vLLM 0.27 to 0.33, checked); --attach reads both")
    p.add_argument("--kv-events-hash", default="int", choices=HASH_FORMATS,
                   help="block hashes as vLLM's default 64-bit ints or as the raw digest bytes")
    p.add_argument("--kv-events-dp-rank", type=int, default=0, metavar="R",
                   help="data-parallel rank stamped into batches; its ports are offset by R, as vLLM's are")
    a = parser.add_argument_group("attach")
    a.add_argument("--attach", default=None, metavar="ADDR",
                   help="subscribe to a running engine's KV events (vLLM, SGLang, kvscope), e.g. "
                        "tcp://HOST:5557, and draw its prefix cache; --block-size is the block size you "
                        "expect (events of another size are counted, not refused)")
    a.add_argument("--replay-endpoint", default=None, metavar="ADDR",
                   help="with --attach: the engine's replay socket (e.g. tcp://HOST:5558), to repair gaps")
    a.add_argument("--dp-size", type=int, default=1, metavar="N",
                   help="with --attach: N data-parallel ranks, on consecutive ports from --attach's")
    a.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="with --attach --headless: stop after this long (default: --steps polls, or Ctrl+C)")
    a.add_argument("--poll-interval", type=float, default=0.1, metavar="SECONDS",
                   help="with --attach: how long one poll waits for events")
    a.add_argument("--max-blocks", type=int, default=200_000, metavar="N",
                   help="with --attach: the most blocks the prefix forest keeps (more are counted as overflow)")


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    if not getattr(args, "kv_events_endpoint", None):
        if getattr(args, "kv_events_replay_endpoint", None):
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    cfg = KVEventsConfig(endpoint=args.kv_events_endpoint, replay_endpoint=args.kv_events_replay_endpoint,
                         topic=args.kv_events_topic, data_parallel_rank=args.kv_events_dp_rank,
                         wire_format=args.kv_events_format, hash_format=args.kv_events_hash)
    cfg.validate()
    return cfg


class KVEventsObserver:
    """A ``Session`` observer: publishes each step record's events; ``close`` releases the ports."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher

    def __call__(self, rec) -> None:
        self.publisher.publish(rec.events)

    def close(self) -> None:
        self.publisher.close()


def open_publisher(args: argparse.Namespace, block_size: int) -> KVEventPublisher | None:
    """With ``--kv-events-endpoint``, a bound publisher (before the model loads: a busy port fails fast)."""
    cfg = kv_events_config(args)
    if cfg is None:
        return None
    pub = KVEventPublisher(cfg, block_size)
    log.info("publishing KV events on %s%s", pub.endpoint,
             f" (replay on {pub.replay_endpoint})" if pub.replay_endpoint else "")
    return pub


def attach_publisher(session, pub: KVEventPublisher | None) -> None:
    """Publish every record of ``session`` through ``pub`` (the session closes it)."""
    if pub is not None:
        session.observers.append(KVEventsObserver(pub))


# --- attach ----------------------------------------------------------------------------------

def attach_config(args: argparse.Namespace) -> AttachConfig:
    cfg = AttachConfig(endpoint=args.attach, replay_endpoint=args.replay_endpoint, topic=args.kv_events_topic,
                       dp_size=args.dp_size, block_size=args.block_size, max_nodes=args.max_blocks)
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
    from .__main__ import NO_DISPLAY, has_display
    if not args.screenshot and not has_display():
        source.close()
        print(NO_DISPLAY, file=sys.stderr)
        return 2
    from .views.prefix_forest import run_attach_window
    return run_attach_window(source, interval=args.poll_interval, screenshot=args.screenshot, steps=args.steps)
