"""``kvscope --headless``: run (or replay) with no Qt at all and print what happened."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.inspect.trace import TraceError

from .kv_events_cli import attach_publisher, open_publisher
from .scenario import ScenarioRunner, load_scenario
from .session import ReplaySession, Session, Summary


def _fail(msg: str, code: int) -> int:
    print(f"kvscope: {msg}", file=sys.stderr)
    return code


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def build_session(config: EngineConfig, args: argparse.Namespace):
    """The session the arguments ask for (a replay, a scenario, or injected prompts). Raises with one line."""
    if args.replay:
        if getattr(args, "kv_events_endpoint", None):
            raise ValueError("--kv-events-endpoint publishes a live engine's events, not a trace replay")
        return ReplaySession(args.replay)
    runner = None
    if args.scenario:
        sc = load_scenario(args.scenario)
        config = dataclasses.replace(config, **sc.config)
        config.validate()
        runner = ScenarioRunner(sc)
    pub = open_publisher(args, config.block_size)
    try:
        session = Session(LLMEngine(config), runner, args.trace, audit=getattr(args, "audit", False))
    except BaseException:
        if pub is not None:
            pub.close()
        raise
    attach_publisher(session, pub)
    return session


def run_headless(config: EngineConfig, args: argparse.Namespace) -> int:
    try:
        session = build_session(config, args)
    except TraceError as e:
        return _fail(one_line(e), 2)
    except ValueError as e:
        return _fail(one_line(e), 2)
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback
        return _fail(one_line(e), 1)
    summary = Summary()
    if not session.read_only:
        prompts = args.inject or ([] if args.scenario else ["Four score and seven years ago our"])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        try:
            for p in prompts:
                session.inject(p, params)
        except ValueError as e:
            return _fail(f"request refused: {one_line(e)}", 2)
        summary.add(session.current())
    limit = args.steps or (session.scenario.scenario.steps if getattr(session, "scenario", None) else None)
    try:
        while session.has_work() and (limit is None or session.step_count < limit):
            summary.add(session.step())
    except TraceError as e:
        return _fail(one_line(e), 2)
    finally:
        session.close()
    if summary.last is None:
        return _fail("nothing to run", 2)
    out = summary.as_dict()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['model']}: {out['steps']} steps, {out['num_blocks']} blocks x {out['block_size']} tokens, "
          f"peak usage {100 * out['kv_cache_usage_perc_peak']:.0f}%")
    for r in out["requests"]:
        print(f"  request {r['request_id']} [{r['status']}]: {r['prompt_tokens']} prompt tokens "
              f"({r['cached_tokens']} cached), {r['output_tokens']} output tokens: {r['text'][:60]!r}")
    print(f"  prefix cache {out['prefix_cache_hits']}/{out['prefix_cache_queries']} tokens hit · "
          f"{out['cow_copies']} CoW copies · {out['evictions']} evictions · {out['num_preemptions']} preemptions "
          f"· {out['swap_outs']} swap-outs / {out['swap_ins']} swap-ins · {out['leaked_blocks']} leaked blocks")
    return 0
