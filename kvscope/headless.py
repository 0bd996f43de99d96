"""``kvscope --headless``: run the engine with no Qt at all and print what it did."""
from __future__ import annotations

import argparse
import json
import sys
import time

from engine import EngineConfig, LLMEngine, SamplingParams


def summarize(engine: LLMEngine, requests: dict[str, dict], seconds: float) -> dict:
    m = engine.metrics()
    return {
        "model": engine.model_name,
        "steps": engine.step_count,
        "seconds": round(seconds, 3),
        "num_blocks": engine.pool.num_blocks,
        "block_size": engine.config.block_size,
        "requests": list(requests.values()),
        "kv_cache_usage_perc": m["kv_cache_usage_perc"],
        "prefix_cache_queries": m["prefix_cache_queries"],
        "prefix_cache_hits": m["prefix_cache_hits"],
        "num_preemptions": m["num_preemptions"],
        "evictions": m["evictions"],
        "generation_tokens": m["generation_tokens"],
        "leaked_blocks": len(engine.audit().leaked_blocks),
    }


def run_headless(config: EngineConfig, args: argparse.Namespace) -> int:
    try:
        engine = LLMEngine(config)
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback
        print(f"kvscope: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    prompts = args.inject or ["Four score and seven years ago our"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows: dict[str, dict] = {}
    for p in prompts:
        try:
            rid = engine.add_request(p, params)
        except ValueError as e:
            print(f"kvscope: request refused: {e}", file=sys.stderr)
            return 2
        rows[rid] = {"request_id": rid, "prompt": p}
    t0 = time.perf_counter()
    while engine.has_unfinished() and (args.steps is None or engine.step_count < args.steps):
        for out in engine.step().outputs:
            rows[out.request_id].update(
                prompt_tokens=len(out.prompt_token_ids), output_tokens=len(out.outputs[0].token_ids),
                cached_tokens=out.num_cached_tokens, finish_reason=out.outputs[0].finish_reason,
                text=out.outputs[0].text)
    summary = summarize(engine, rows, time.perf_counter() - t0)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{summary['model']}: {summary['steps']} steps in {summary['seconds']} s, "
              f"{summary['num_blocks']} blocks x {summary['block_size']} tokens")
        for r in summary["requests"]:
            print(f"  request {r['request_id']}: {r.get('prompt_tokens', 0)} prompt tokens "
                  f"({r.get('cached_tokens', 0)} cached), {r.get('output_tokens', 0)} output tokens: "
                  f"{r.get('text', '')!r}")
        print(f"  prefix cache: {summary['prefix_cache_hits']}/{summary['prefix_cache_queries']} tokens hit, "
              f"{summary['evictions']} evictions, {summary['num_preemptions']} preemptions, "
              f"{summary['leaked_blocks']} leaked blocks")
    return 0
