"""Command line: every engine setting (generated from ``EngineConfig``'s fields), plus the app's modes.

Each ``EngineConfig`` field becomes ``--field-name`` with its type, default, help and choices
from the field's metadata; a bool becomes ``--x/--no-x`` (plus any alias the metadata names,
such as ``--no-prefix-caching``). The app's own options (window, headless, scenario, trace,
screenshot) are written here by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from engine import EngineConfig
from engine.config import config_fields
from engine.config_options import OneLineParser, add_field_option
from engine.inspect.kv_events import HASH_FORMATS, WIRE_FORMATS
from kvscope.cli.arg_types import (
    font_scale,
    port,
    positive_float,
    positive_int,
    timeout_seconds,
    token_ids,
    window_size,
)
from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.serve.options import ServeOptions
from kvscope.sources.fleet_spec import HASH_ALGO_CHOICES

ENGINE_GROUPS = ("model", "KV cache", "scheduler", "debugging")


# The panels below the grid (MainWindow.docks) that --view can bring to the front.
VIEWS = ("figure", "events", "diagnosis", "fragmentation", "plots", "miss", "welcome")  # welcome: the first screen


def add_engine_options(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    groups = {name: p.add_argument_group(name) for name in ENGINE_GROUPS}
    for f in config_fields():
        add_field_option(groups.get(f.metadata.get("group"), p), EngineConfig, f)
    return groups


def add_workload_args(p: argparse.ArgumentParser) -> None:
    from engine.workload.fleet_config import FleetConfig  # no torch
    from engine.workload.sim_config import SimConfig

    g = p.add_argument_group(
        "workload (a request trace played through the scheduler and block pool, without "
        "weights: a cost model's step time stands in for the forward pass; docs/workloads.md)"
    )
    g.add_argument(
        "--workload",
        default=None,
        metavar="FILE",
        help="play this trace: Mooncake's JSONL (timestamp, input_length, output_length, hash_ids) or "
        "kvscope's (arrival, prompt, max_tokens); the window plays it live, --headless prints "
        "its hit rate, evictions, preemptions and TTFT",
    )
    for f in dataclasses.fields(SimConfig):
        add_field_option(g, SimConfig, f)
    g.add_argument(
        "--sweep-kv-tokens",
        default=None,
        metavar="LIST",
        help="with --headless --workload: run every capacity in this list of token counts "
        "(1e4,1e5,1e6,...), print the table and draw hit rate against capacity (--png)",
    )
    g.add_argument(
        "--png",
        default=None,
        metavar="FILE",
        help="with --sweep-kv-tokens or --sweep-instances: the plot's file (default: "
        "TRACE_hit_rate.png or TRACE_fleet.png here)",
    )
    f = p.add_argument_group("fleet (a workload over N simulated instances behind a router; docs/routing.md)")
    for fld in dataclasses.fields(FleetConfig):
        add_field_option(f, FleetConfig, fld)
    f.add_argument(
        "--sweep-instances",
        default=None,
        metavar="LIST",
        help="with --headless --workload: a fleet of each size in this list (1,2,4,8,16) per --router; "
        "prints the table and draws hit rate, TTFT and load imbalance against N (--png)",
    )
    g.add_argument(
        "--limit", type=positive_int, default=None, metavar="N", help="with --workload: only its first N requests"
    )


def sim_config(args: argparse.Namespace):
    """The workload's simulated machine and mode; a ``--sim-*`` option without ``--workload`` is refused."""
    from engine.workload.fleet_config import FleetConfig
    from engine.workload.sim_config import SimConfig

    sim = SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})
    if not args.workload:
        given = [
            f.name
            for cls in (SimConfig, FleetConfig)
            for f in dataclasses.fields(cls)
            if getattr(args, f.name) != f.default
        ]
        given += [n for n in ("sweep_kv_tokens", "sweep_instances", "png", "limit") if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} plays a workload: give --workload FILE too")
    sim.validate()
    return sim


def fleet_config(args: argparse.Namespace):
    """The fleet the workload runs on (``FleetConfig``; ``instances`` None: one engine)."""
    from engine.workload.fleet_config import FleetConfig

    return FleetConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FleetConfig)})


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="kvscope",
        description="Inspect a paged KV cache live: a real Llama-family model runs on a worker thread while the "
        "window draws the physical block pool, block tables, ref counts, the prefix cache and "
        "preemptions step by step. With no --model it runs the embedded SmolLM2-135M-Instruct.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_options(p)
    a = p.add_argument_group("app")
    a.add_argument("--headless", action="store_true", help="no window: run and print a summary")
    a.add_argument("--json", action="store_true", help="with --headless: print the summary as JSON")
    a.add_argument(
        "--compare-caching",
        action="store_true",
        help="with --headless: run the requests (the scenario's or --inject's, one after another, "
        "greedy) with prefix caching on and off, and print the first token where they differ",
    )
    a.add_argument(
        "--explain-block",
        type=int,
        default=None,
        metavar="ID",
        help="with --headless: print block ID's life story from the event stream (who allocated, "
        "stored, hit, copied, swapped, freed it; for a leaked block, who kept it)",
    )
    a.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="run to step N (headless, screenshot, and a window; a replay's steps count from its step 0); "
        "default: until done (a window: none)",
    )
    a.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="TEXT",
        help="inject a request with this prompt at start (repeatable)",
    )
    a.add_argument(
        "--inject-ids",
        action="append",
        default=[],
        metavar="IDS",
        type=token_ids,
        help="inject a request whose prompt is these token ids, e.g. 1,5,9 (repeatable; for a model "
        "without a tokenizer)",
    )
    a.add_argument("--max-tokens", type=positive_int, default=48, help="max tokens of --inject requests")
    a.add_argument(
        "--scenario",
        default=None,
        metavar="NAME_OR_FILE",
        help="run a scenario from resources/scenarios, by name or alias (two-requests, sharing, "
        "copy-on-write, preemption, ...); an engine flag given beside it is applied over its "
        "setting, or refused in one line where the setting is its lesson (--fault)",
    )
    a.add_argument(
        "--list-scenarios", action="store_true", help="print every scenario with its aliases and title, and exit"
    )
    a.add_argument("--trace", default=None, metavar="FILE", help="record the run as a JSON-lines trace")
    a.add_argument("--replay", default=None, metavar="FILE", help="play a recorded trace back (no model, no GPU)")
    a.add_argument("--audit", action="store_true", help="audit ref counts after every step")
    a.add_argument(
        "--window-size",
        type=window_size,
        default=None,
        metavar="WxH",
        help="the window's size, e.g. 1280x720 (default: as last time; --screenshot: 1600x1000)",
    )
    a.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine on a thread of the window's process instead of its own process",
    )
    a.add_argument(
        "--screenshot",
        metavar="FILE",
        default=None,
        help="build the window offscreen, run --steps steps, save a PNG of the window, exit",
    )
    a.add_argument(
        "--select",
        default=None,
        metavar="IDS",
        help="--screenshot: select these requests (comma-separated ids, e.g. 0,1: the figure view "
        "shows them side by side); default: the request with the most blocks",
    )
    a.add_argument(
        "--select-block",
        type=int,
        default=None,
        metavar="ID",
        help="--screenshot: click this block first: its life story shows in the Why? tab",
    )
    a.add_argument(
        "--font-scale",
        type=font_scale,
        default=None,
        metavar="X",
        help="every view's text at X times its size (1.25-2 for a projector; also View > Text size, "
        "kept in the settings)",
    )
    a.add_argument(
        "--present",
        action="store_true",
        help="presentation, for a projector (also View > Presentation, F11): a page laid out for 1280x720, the "
        "lesson's panel over its note, the whole pool and a legend, text 18 px; F10 steps, PgDn/PgUp change lessons",
    )
    a.add_argument(
        "--view",
        default=None,
        choices=VIEWS,
        help="bring this panel to the front at start (with --screenshot: in the picture); welcome: "
        "the first screen, before any request",
    )
    a.add_argument(
        "--compare",
        action="store_true",
        help="--screenshot: run the caching on/off comparison (the Why? tab) before saving",
    )
    add_serve_args(p)
    add_kv_events_args(p)
    add_workload_args(p)
    add_probe_args(p)
    add_limit_args(p)
    return p


def probe_faults() -> tuple[str, ...] | None:
    """The faults the probe can switch on, or None without its package (``--probe`` then says how to install it)."""
    try:
        from kvscope_vllm_probe.constants import FAULTS
    except ImportError:
        return None
    return FAULTS


def add_probe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "a running vLLM through kvscope's probe (pip install ./probe into vLLM's environment and kvscope's, "
        "then start vLLM with KVSCOPE_PROBE_ENDPOINT=tcp://HOST:PORT)"
    )
    g.add_argument(
        "--probe",
        default=None,
        metavar="ADDR",
        help="show that vLLM's whole block pool, audited every step, every data-parallel rank (rank r at PORT+r); "
        "Pause, Step and Run hold its scheduler if vLLM allows it (KVSCOPE_PROBE_CONTROL=1) "
        "(with --headless: --duration seconds, --steps vLLM steps, or Ctrl+C)",
    )
    g.add_argument(
        "--probe-wait",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="with --probe: how long to wait for vLLM's probe to answer (vLLM may start after kvscope)",
    )
    g.add_argument(
        "--probe-fault",
        default=None,
        choices=probe_faults(),
        help="with --probe: switch this fault on inside vLLM, if vLLM allows it (KVSCOPE_PROBE_REMOTE_FAULTS=1) "
        "(leak-last-block: the next finished request's last block is never freed; the audit finds it)",
    )
    g.add_argument(
        "--probe-key",
        default=None,
        metavar="FILE",
        help="with --probe: kvscope's secret CURVE certificate, for a probe that asks for keys (one on the network); "
        "default $KVSCOPE_PROBE_KEY (python -m kvscope_vllm_probe.keys DIR makes the certificates)",
    )
    g.add_argument(
        "--probe-server-key",
        default=None,
        metavar="FILE",
        help="with --probe-key: the probe's public certificate (default $KVSCOPE_PROBE_SERVER_KEY)",
    )


def add_limit_args(p: argparse.ArgumentParser) -> None:
    from kvscope.limits import LIMITS

    g = p.add_argument_group(
        "window limits (how much of a long run the window keeps; the oldest go first, never what is on screen)"
    )
    g.add_argument(
        "--timeline-mib",
        type=positive_float,
        default=LIMITS.timeline_bytes / 2**20,
        metavar="MIB",
        help="the timeline's memory: every step's state the slider and the plots can go back to",
    )
    g.add_argument(
        "--timeline-requests",
        type=positive_int,
        default=LIMITS.timeline_requests,
        metavar="N",
        help="the requests whose rows the timeline keeps",
    )
    g.add_argument(
        "--event-log-rows", type=positive_int, default=LIMITS.event_log_rows, metavar="N", help="the event log's rows"
    )
    g.add_argument(
        "--miss-explanations",
        type=positive_int,
        default=LIMITS.miss_explanations,
        metavar="N",
        help="the requests whose prefix-cache miss is explained (the selected one is always kept)",
    )
    g.add_argument(
        "--evicted-blocks",
        type=positive_int,
        default=LIMITS.evicted_blocks,
        metavar="N",
        help="evicted blocks remembered to say 'evicted at step s' in a miss's explanation",
    )


def window_limits(args: argparse.Namespace):
    from kvscope.limits import WindowLimits

    return WindowLimits(
        int(args.timeline_mib * 2**20),
        args.timeline_requests,
        args.event_log_rows,
        args.miss_explanations,
        args.evicted_blocks,
    )


_UNSET = object()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, with ``engine_flags_given``: the ``EngineConfig`` fields a flag set (a default is not
    given), which a scenario's settings do not override (``kvscope.scenario.scenario_config``)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # a bad flag exits 2 with one line
    # parsed again over a namespace that already holds every engine field: argparse sets no default over
    # an attribute that exists, so what changed was given
    probe = parser.parse_args(argv, namespace=argparse.Namespace(**{f.name: _UNSET for f in config_fields()}))
    args.engine_flags_given = frozenset(f.name for f in config_fields() if getattr(probe, f.name) is not _UNSET)
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's part of the arguments: one attribute per ``EngineConfig`` field."""
    cfg = EngineConfig(**{f.name: getattr(args, f.name) for f in config_fields()})
    cfg.validate()
    return cfg


def source_spec(config: EngineConfig, args: argparse.Namespace, serve: ServeOptions | None = None):
    """What the arguments ask a source to be built from (picklable: the engine process builds it)."""
    from kvscope.runtime.build import SourceSpec  # the sources' modules: not needed to print --help

    workload = None
    if getattr(args, "workload", None):
        from kvscope.sources.workload import WorkloadSpec

        workload = WorkloadSpec(args.workload, sim_config(args), args.limit)
    probe = None
    if getattr(args, "probe", None):
        from kvscope.runtime.build import ProbeSpec

        key, server_key = probe_keys(args)
        probe = ProbeSpec(args.probe, args.probe_wait, args.probe_fault, key, server_key)
    return SourceSpec(
        config,
        args.scenario,
        args.replay,
        args.trace,
        bool(args.audit),
        serve=serve,
        kv_events=kv_events_config(args),
        workload=workload,
        probe=probe,
        given=getattr(args, "engine_flags_given", frozenset()),
    )


def probe_keys(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``--probe-key`` and ``--probe-server-key``, or their environment variables (read here, not in the parser:
    --help must not print a path to a secret)."""
    key = getattr(args, "probe_key", None) or os.environ.get("KVSCOPE_PROBE_KEY") or None
    server = getattr(args, "probe_server_key", None) or os.environ.get("KVSCOPE_PROBE_SERVER_KEY") or None
    return key, server


def serve_options(args: argparse.Namespace) -> ServeOptions:
    # The key's default is read here, not in the parser: --help must never print it.
    key = getattr(args, "api_key", None) or os.environ.get("KVSCOPE_API_KEY") or None
    return ServeOptions(args.host, args.port, key, args.request_timeout)


# -- serving flags ---------------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serving (an OpenAI-compatible HTTP server beside the engine)")
    g.add_argument(
        "--serve",
        action="store_true",
        help="serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics while the "
        "window (or --headless) shows the pool; the window starts in Run",
    )
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; serving beyond this machine needs an explicit one (e.g. 0.0.0.0)",
    )
    g.add_argument("--port", type=port, default=8000, help="TCP port to listen on (0: any free port)")
    g.add_argument(
        "--api-key",
        default=argparse.SUPPRESS,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSCOPE_API_KEY if set, else no key)",
    )
    g.add_argument(
        "--request-timeout",
        type=timeout_seconds,
        default=None,
        metavar="SECONDS",
        help="abort a request still running this long after it arrived (HTTP 504)",
    )


# -- KV events flags -------------------------------------------------------------------------------
def add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("KV events (vLLM's wire format: publish, or attach to vLLM / SGLang)")
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ADDR",
        help="publish every step's block stores, evictions and cache resets on this ZeroMQ PUB "
        "address, e.g. tcp://127.0.0.1:5557 (kvscope binds it)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ADDR",
        help="with --kv-events-endpoint: answer replay requests here, e.g. tcp://127.0.0.1:5558",
    )
    p.add_argument(
        "--kv-events-topic",
        default="",
        metavar="TOPIC",
        help="topic of published batches; with --attach, the subscription prefix",
    )
    p.add_argument(
        "--kv-events-format",
        default="array",
        choices=WIRE_FORMATS,
        help="events as positional arrays (vLLM's example subscriber, SGLang, vLLM up to 0.20) "
        "or as maps with a 'type' key (vLLM 0.27 to 0.33, checked); --attach reads both",
    )
    p.add_argument(
        "--kv-events-hash",
        default="int",
        choices=HASH_FORMATS,
        help="block hashes as vLLM's default 64-bit ints or as the raw digest bytes",
    )
    p.add_argument(
        "--kv-events-dp-rank",
        type=int,
        default=0,
        metavar="R",
        help="data-parallel rank stamped into batches; its ports are offset by R, as vLLM's are",
    )
    a = parser.add_argument_group("attach (one engine, or a fleet of them: docs/attach.md, docs/fleet.md)")
    a.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="ADDR",
        help="subscribe to a running engine's KV events (vLLM, SGLang, kvscope), e.g. "
        "tcp://HOST:5557, and draw its prefix cache; --block-size is the block size you "
        "expect (events of another size are counted, not refused). Repeat it to watch a fleet: "
        "one forest saying which instance holds which block, and the blocks held twice",
    )
    a.add_argument(
        "--replay-endpoint",
        action="append",
        default=[],
        metavar="ADDR",
        help="with --attach: the engine's replay socket (e.g. tcp://HOST:5558), to repair gaps; with "
        "several --attach, one for each, in the same order",
    )
    a.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="with --attach: N data-parallel ranks, on consecutive ports from --attach's",
    )
    a.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --attach or --probe, --headless: stop after this long (default: --steps polls or steps, or Ctrl+C)",
    )
    a.add_argument(
        "--poll-interval",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="with --attach: how long one poll waits for events",
    )
    a.add_argument(
        "--max-blocks",
        type=int,
        default=200_000,
        metavar="N",
        help="with --attach: the most blocks the prefix forest keeps (more are counted as overflow); "
        "a fleet: per instance",
    )
    f = parser.add_argument_group(
        "fleet (several engines watched together, and where a prompt would go: docs/fleet.md)"
    )
    f.add_argument(
        "--fleet",
        default=None,
        metavar="FILE",
        help="watch the instances this JSON or TOML file names (name, endpoint, replay_endpoint, "
        "block_size, bytes_per_block, hash_algo, hash_seed, metrics for each)",
    )
    f.add_argument(
        "--route-prompt",
        default=None,
        metavar="TEXT",
        help="with a fleet: where would this prompt go? Each instance's longest cached prefix of it, "
        "in blocks, as a precise prefix-aware router scores it (tokenized with --tokenizer, else "
        "--model's tokenizer, else the embedded SmolLM2's)",
    )
    f.add_argument(
        "--route-ids",
        type=token_ids,
        default=None,
        metavar="IDS",
        help="with a fleet: the same for a prompt given as token ids, e.g. 1,5,9",
    )
    f.add_argument(
        "--bytes-per-block",
        type=positive_int,
        default=None,
        metavar="N",
        help="with several --attach: the model's KV bytes per block, to give duplicated blocks in bytes",
    )
    f.add_argument(
        "--prefix-caching-hash-algo",
        default="auto",
        choices=HASH_ALGO_CHOICES,
        help="with several --attach: the instances' vLLM --prefix-caching-hash-algo, to hash a "
        "prompt as they do (auto: found from the first blocks they store)",
    )
    f.add_argument(
        "--hash-seed",
        default=None,
        metavar="SEED",
        help="with several --attach: the instances' PYTHONHASHSEED (unset: vLLM's default seed)",
    )


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    if not getattr(args, "kv_events_endpoint", None):
        if getattr(args, "kv_events_replay_endpoint", None):
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    cfg = KVEventsConfig(
        endpoint=args.kv_events_endpoint,
        replay_endpoint=args.kv_events_replay_endpoint,
        topic=args.kv_events_topic,
        data_parallel_rank=args.kv_events_dp_rank,
        wire_format=args.kv_events_format,
        hash_format=args.kv_events_hash,
    )
    cfg.validate()
    return cfg
