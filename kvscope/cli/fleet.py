"""``kvscope --attach A --attach B ...`` or ``kvscope --fleet FILE``: a fleet of engines watched together, headless
or in a window, and ``--route-prompt`` / ``--route-ids``: where a prompt would go.

Every refusal (a bad fleet file, flags that do not go together, a tokenizer that cannot load) is one line and exit
2 before any socket opens, the same line in the window and headless: both call ``open_fleet`` first.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.messages import one_line
from kvscope.cli.headless import drive
from kvscope.messages import bytes_text
from kvscope.sources.fleet import FleetSource
from kvscope.sources.fleet_route import RouteAnswer
from kvscope.sources.fleet_spec import FleetSpec, InstanceSpec, check_fleet, check_zmq_address, read_fleet_file
from kvscope.sources.poll_summary import PollSummary

_PER_INSTANCE_FLAGS = (
    ("replay_endpoint", "--replay-endpoint", []),
    ("dp_size", "--dp-size", 1),
    ("bytes_per_block", "--bytes-per-block", None),
    ("prefix_caching_hash_algo", "--prefix-caching-hash-algo", "auto"),
    ("hash_seed", "--hash-seed", None),
)


def is_fleet(args: argparse.Namespace) -> bool:
    """A fleet run: a fleet file, several --attach, or a prompt to route (even over one instance)."""
    return bool(args.fleet or len(args.attach) > 1 or args.route_prompt is not None or args.route_ids)


def fleet_spec(args: argparse.Namespace) -> FleetSpec:
    """The fleet the arguments name, checked (raises ``ValueError`` with one line)."""
    if args.route_prompt is not None and args.route_ids:
        raise ValueError("give the prompt to route once: --route-prompt TEXT or --route-ids IDS")
    if args.trace:
        raise ValueError("--trace records one --attach; a fleet is not recorded")
    if args.poll_interval <= 0:
        raise ValueError("--poll-interval must be > 0")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration must be > 0")
    if args.max_blocks < 1:
        raise ValueError("--max-blocks must be >= 1")
    if args.fleet:
        if args.attach:
            raise ValueError("name the fleet's instances with --attach or in --fleet FILE, not both")
        for name, flag, default in _PER_INSTANCE_FLAGS:
            if getattr(args, name) != default:
                raise ValueError(f"{flag} is set for each instance in the fleet file (with --fleet)")
        return read_fleet_file(args.fleet)
    if not args.attach:
        raise ValueError("--route-prompt and --route-ids ask a fleet: give --attach ADDR (repeatable) or --fleet FILE")
    replays = args.replay_endpoint
    if replays and len(replays) != len(args.attach):
        raise ValueError(
            f"{len(args.attach)} --attach but {len(replays)} --replay-endpoint: give one for each "
            f"--attach, in the same order, or none"
        )
    if args.dp_size < 1:
        raise ValueError("--dp-size must be >= 1")
    twice = next((a for i, a in enumerate(args.attach) if a in args.attach[:i]), None)
    if twice is not None:
        raise ValueError(f"--attach {twice} is given twice")
    instances = []
    for i, addr in enumerate(args.attach):
        check_zmq_address(addr, "--attach")
        if replays:
            check_zmq_address(replays[i], "--replay-endpoint")
        name = addr.split("://", 1)[1]  # host:port, unique as the addresses are
        instances.append(
            InstanceSpec(
                name,
                addr,
                replays[i] if replays else None,
                args.kv_events_topic,
                args.dp_size,
                args.block_size,
                args.bytes_per_block,
                args.prefix_caching_hash_algo,
                args.hash_seed,
            )
        )
    return check_fleet(FleetSpec(tuple(instances), "--attach"))


def route_tokens(args: argparse.Namespace, tokenizer) -> list[int] | None:
    """The prompt to route as token ids: ``--route-ids``, or ``--route-prompt`` through ``tokenizer``."""
    if args.route_ids:
        return list(args.route_ids)
    if args.route_prompt is None:
        return None
    if not args.route_prompt:
        raise ValueError("--route-prompt: the prompt is empty")
    return list(tokenizer.encode(args.route_prompt))


def route_tokenizer(args: argparse.Namespace):
    """The served model's tokenizer: ``encode(text)`` makes token ids as vLLM's /v1/completions does of a text
    prompt (special tokens added as the tokenizer adds them). Raises ``ValueError`` with one line."""
    from engine.runner.models.loader import embedded_folder, load_tokenizer, resolve_model

    try:
        if args.tokenizer:  # a folder, a .gguf file or a hub id, as the engine's --tokenizer
            tok = load_tokenizer(args.tokenizer)
        elif args.model:  # the model's own: its short name, folder, .gguf or hub id resolved as the engine does
            src = resolve_model(args.model)
            tok = load_tokenizer(f"{src.path}/{src.gguf_file}" if src.gguf_file else src.path)
        else:  # the embedded SmolLM2, as a folder: what a vLLM serving it reads
            tok = load_tokenizer(str(embedded_folder()))
    except (OSError, ValueError) as e:
        raise ValueError(one_line(e)) from None
    return tok


def open_fleet(args: argparse.Namespace) -> tuple[FleetSource, list[int] | None, object | None, str | None]:
    """The fleet's source, the prompt to route, the tokenizer and why there is none; raises ``ValueError`` with one
    line (a bad fleet, a prompt that cannot be tokenized) before any socket opens. Without ``--route-prompt`` the
    tokenizer is loaded only for a window's prompt box, and one that cannot load is said there, not refused."""
    spec = fleet_spec(args)
    tokenizer = error = None
    if args.route_prompt is not None or not args.headless:
        try:
            tokenizer = route_tokenizer(args)
        except ValueError as e:
            if args.route_prompt is not None:
                raise
            error = f"no tokenizer ({e}): the prompt box takes token ids"
    tokens = route_tokens(args, tokenizer)
    # In a window the timer polls every --poll-interval and a poll never waits: the GUI thread must not block.
    source = FleetSource(spec, poll_interval=args.poll_interval if args.headless else 0.0, max_blocks=args.max_blocks)
    return source, tokens, tokenizer, error


def fleet_summary_lines(out: dict) -> list[str]:
    """A fleet's ``PollSummary.as_dict()['fleet']`` in text: each instance, the fleet in all, and the route's answer."""
    a = out["in_all"]
    lines = [
        f"fleet ({out['origin']}): {a['instances']} instances, {a['up']} up; {out['polls']} polls in {out['seconds']} s"
    ]
    width = max(len(r["name"]) for r in out["instances"])
    for r in out["instances"]:
        m = r["metrics"] or {}
        usage = f"usage {100 * m['kv_cache_usage_perc']:.0f}%" if "kv_cache_usage_perc" in m else "usage -"
        flags = f" [{', '.join(r['flags'])}]" if r["flags"] else ""
        lines.append(
            f"  {r['name']:<{width}}  {r['state']:<10} {r['blocks']:>7} blocks {r['tokens']:>9} tokens  "
            f"{usage}  +{r['stored_per_s']}/s -{r['removed_per_s']}/s  {r['shared_blocks']} also "
            f"elsewhere{flags}"
        )
        lines.append(f"  {'':<{width}}  hashes: {r['hashes']}")
    extra = f", {bytes_text(a['extra_bytes'])} beyond one copy each" if a["extra_bytes"] else ""
    lines.append(
        f"  in all: {a['blocks']} blocks, {a['distinct_blocks']} distinct; {a['duplicated_blocks']} held by "
        f"two or more instances ({a['copies']} copies, {a['extra_copies']} extra{extra})"
    )
    route = out.get("route")
    if route is not None:
        lines.append(f"  where would it go ({route['prompt_tokens']} tokens): {route['answer']}")
        for s in route["instances"]:
            got = f"{s['blocks']} of {s['prompt_blocks']} blocks" if s["blocks"] is not None else "not scored"
            lines.append(f"    {s['instance']:<{width}}  {got}{': ' + s['note'] if s['note'] else ''}")
    return lines


def run_fleet_headless(source: FleetSource, args: argparse.Namespace, tokens: list[int] | None) -> int:
    """The one headless loop; each instance that goes, comes back, restarts or loses batches is one line on stderr
    as it happens; at the end the ``fleet`` object (``--json``) or its lines, with the route's answer."""
    summary = PollSummary(source)

    def on_record(rec) -> None:
        summary.add(rec)
        if rec.notice:
            for line in rec.notice.split("; "):
                print(f"kvscope: {line}", file=sys.stderr, flush=True)

    failed = drive(source, on_record, args.steps, args.duration, until_interrupted=True)
    if failed is not None:
        return failed
    if summary.last is None:
        print("kvscope: nothing to show (no poll ran)", file=sys.stderr)
        return 2
    route: RouteAnswer | None = source.route(tokens) if tokens is not None else None
    out = summary.as_dict(route=route)
    print(json.dumps(out, indent=2) if args.json else "\n".join(fleet_summary_lines(out["fleet"])))
    return 0


def run_fleet(args: argparse.Namespace) -> int:
    """``kvscope --fleet FILE`` or several ``--attach``: exit 2 with one line on bad input, in a window or not."""
    try:
        source, tokens, tokenizer, error = open_fleet(args)
    except ValueError as e:
        print(f"kvscope: {one_line(e)}", file=sys.stderr)
        return 2
    if args.headless:
        return run_fleet_headless(source, args, tokens)
    from kvscope.cli.window import run_fleet_window  # the display and Qt's libraries checked, as for any window

    return run_fleet_window(
        source, args, tokenizer, error, args.route_prompt if args.route_prompt is not None else tokens
    )
