"""``kvscope --headless``: run (or replay) with no Qt at all and print what happened.

``drive`` is the one headless loop over any ``Source`` (a live engine, a trace replay, an attached engine
or its replay); what is printed after it is the source's summary (``Summary``, or ``PollSummary`` in
``cli.attach``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from engine import EngineConfig, SamplingParams
from engine.inspect.audit import AuditReport
from engine.inspect.block_story import BlockStory, format_story
from engine.messages import one_line
from kvscope.cli.parser import source_spec
from kvscope.diagnosis import CACHING_OFF
from kvscope.prefill_progress import prefill_progress
from kvscope.runtime.build import build_source
from kvscope.sources.base import Source, StepRecord
from kvscope.sources.summary import Summary


def _fail(msg: str, code: int) -> int:
    print(f"kvscope: {msg}", file=sys.stderr)
    return code


def drive(
    source: Source,
    on_record: Callable[[StepRecord], None],
    limit: int | None = None,
    duration: float | None = None,
    until_interrupted: bool = False,
) -> int | None:
    """Step ``source`` while it has work, at most ``limit`` steps and ``duration`` seconds, each record to
    ``on_record``; the source is closed at the end. Returns None, or the exit code of a failure already said
    in one line on stderr (2: bad input, a corrupt trace, a request refused; 1: anything else).
    ``until_interrupted``: Ctrl+C ends the run as its limits would (a source whose work never ends)."""
    # steps run, counted: a record of step 0 is the state before any step (a recorded vLLM's first), not a step, so
    # --steps N ends at step N whatever the source (a live engine's and a kvscope trace's records start at step 1)
    taken, t0 = 0, time.monotonic()
    try:
        while (
            source.has_work()
            and (limit is None or taken < limit)
            and (duration is None or time.monotonic() - t0 < duration)
        ):
            rec = source.step()
            on_record(rec)
            taken += rec.step != 0 or rec.snapshot is None  # an attach or fleet poll is a step, numbered from 0
    except KeyboardInterrupt:
        if not until_interrupted:
            raise
    except ValueError as e:  # a corrupt trace line, a scenario request the engine refused mid-run
        return _fail(one_line(e), 2)
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback
        return _fail(one_line(e), 1)
    finally:
        source.close()
    return None


def build_session(config: EngineConfig, args: argparse.Namespace, hooks: list | None = None):
    """The source the arguments ask for (a replay, a scenario, or injected prompts). Raises with one line.

    ``hooks``: more ``StepHook``s of a live source (the HTTP server's bridge).
    """
    return build_source(source_spec(config, args), hooks)


def run_headless(config: EngineConfig, args: argparse.Namespace) -> int:
    try:
        session = build_session(config, args)
    except ValueError as e:  # bad input or configuration (TraceError, an unknown model, no CUDA, ...)
        return _fail(one_line(e), 2)
    except OSError as e:  # e.g. a --trace path that cannot be written
        return _fail(one_line(e), 2)
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback
        return _fail(one_line(e), 1)
    from engine.gc_policy import tune_gc

    tune_gc()  # the loaded heap frozen, fewer collections
    if getattr(args, "compare_caching", False):
        return _compare_caching(session, args)

    def new_summary() -> Summary:
        return Summary(
            decode=session.decode,
            max_model_len=session.info.max_model_len,
            prefix_caching=session.info.prefix_caching,
            kv_groups=tuple(session.info.extra.get("kv_groups", ())),
        )

    summary = new_summary()
    ranks = None
    if getattr(session, "ranks", None) is not None:  # a probed vLLM: every data-parallel rank's summary too
        from kvscope.cli.probe_ranks import RankSummaries

        ranks = RankSummaries(session, summary, new_summary)
    explain = getattr(args, "explain_block", None)
    if explain is not None and not 0 <= explain < session.info.num_blocks:
        session.close()
        last = session.info.num_blocks - 1
        return _fail(f"--explain-block {explain}: no such block (the pool has blocks 0-{last})", 2)
    story = BlockStory(explain, session.decode) if explain is not None else None
    if not session.info.read_only:
        prompts = args.inject + args.inject_ids or ([] if args.scenario else ["Four score and seven years ago our"])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        try:
            for p in prompts:
                session.inject(p, params)
        except ValueError as e:
            return _fail(f"request refused: {one_line(e)}", 2)
        rec = session.current()
        summary.add(rec)
        if story:
            story.feed(rec.step, rec.events)
    limit = args.steps or (session.scenario.scenario.steps if getattr(session, "scenario", None) else None)

    def on_record(rec: StepRecord) -> None:
        summary.add(rec)
        if rec.notice:  # a probed vLLM that restarted, say: one line, and the run goes on
            print(f"kvscope: {rec.notice}", file=sys.stderr, flush=True)
        progress = prefill_progress(rec.snapshot)
        if progress:  # a long prompt in chunks: say how far (stderr: --json's stdout stays JSON)
            print(f"kvscope: step {rec.step}: {progress}", file=sys.stderr, flush=True)
        if story:
            story.feed(rec.step, rec.events)

    if args.probe:  # a run that ends on Ctrl+C: say when it reads (a Ctrl+C before this line is an interrupted start)
        print(f"kvscope: reading vLLM's probe at {args.probe}: Ctrl+C ends the run with its summary", file=sys.stderr)
    failed = drive(session, on_record, limit, getattr(args, "duration", None), until_interrupted=bool(args.probe))
    if failed is not None:
        return failed
    if summary.last is None:
        return _fail("nothing to run", 2)
    out = summary.as_dict()
    out["kv_pool_bytes"] = session.info.num_blocks * session.info.block_bytes  # sized once, at start-up
    out["device_free_bytes"] = device_free(session.info.device)
    out["kv_layout"] = session.info.kv_layout
    if ranks is not None:
        out.update(ranks.as_dict())
    if story is not None:
        out["block_story"] = {
            "block_id": explain,
            "events": [
                {"step": ln.step, "kind": ln.kind, "text": ln.text, "holders": list(ln.holders)} for ln in story.lines
            ],
        }
        if not args.json:
            print(format_story(explain, story.lines))
            return 0
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print("\n".join(summary_lines(out)))
    return 0


def summary_lines(out: dict) -> list[str]:
    """The run's key lines in text, from the same summary ``--json`` prints: the pool, each request with
    its first prefix-cache miss, the hit rate and the misses by reason, the counters, the audit."""
    lines = [
        f"{out['model']}: {out['steps']} steps, {out['num_blocks']} blocks x {out['block_size']} tokens, "
        f"peak usage {100 * out['kv_cache_usage_perc_peak']:.0f}%"
    ]
    reasons: dict[str, int] = {}
    for r in out["requests"]:
        lines.append(
            f"  request {r['request_id']} [{r['status']}]: {r['prompt_tokens']} prompt tokens "
            f"({r['cached_tokens']} cached), {r['output_tokens']} output tokens: {r['text'][:60]!r}"
        )
        miss = r.get("prefix_cache_miss")
        if miss:
            reasons[miss["reason"]] = reasons.get(miss["reason"], 0) + 1
            lines.append(f"    first miss: {miss['reason']}: {miss['detail']}")
    queries, hits = out["prefix_cache_queries"], out["prefix_cache_hits"]
    rate = f"{100 * hits / queries:.0f}%" if queries else "no queries"
    by_reason = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda t: -t[1]))
    if out.get("prefix_caching", True):
        lines.append(
            f"  prefix cache hit rate {rate} ({hits}/{queries} tokens)"
            + (f"; first misses: {by_reason}" if by_reason else "")
        )
    else:
        lines.append(f"  {CACHING_OFF}")
    f = out.get("fragmentation")
    if f:  # the step that held the most blocks: this run's pool, then both layouts of the same requests
        lines.append(
            f"  fragmentation at step {f['step']} (the most blocks held): {f['blocks_held']} blocks = "
            f"{f['used_slots']:,} slots used, {f['wasted_slots']:,} wasted inside blocks, "
            f"{f['reserved_slots']:,} reserved and not written"
        )
        lines += [
            f"    {name}{' (this run)' if name == out.get('kv_layout') else ''}, each request alone: "
            f"{c['used_slots']:,} used, {c['wasted_slots']:,} wasted, {c['reserved_slots']:,} reserved"
            + (" (a max_model_len reservation each)" if name == "contiguous" else "")
            for name, c in f["layouts"].items()
        ]
    lines.append(
        f"  {out['cow_copies']} CoW copies · {out['evictions']} evictions · {out['num_preemptions']} "
        f"preemptions · {out['swap_outs']} swap-outs / {out['swap_ins']} swap-ins "
        f"· {audit_counts_text(out)}"
    )
    n = out.get("audit_steps_with_problems", 0)
    if n:  # the run's, not the last step's: a pool can heal
        lines.append(f"  audit over the run: problems on {n} step{'' if n == 1 else 's'}")
    lines += [f"  audit: {problem}" for problem in out["audit_problems"]]
    return lines


def audit_counts_text(out: dict) -> str:
    """ "1 block flagged by the audit: 1 written while shared (0 leaked)": leaks apart from the other kinds."""
    n, kinds = out["flagged_blocks"], out["audit_blocks_by_kind"]
    text = f"{n} block{'' if n == 1 else 's'} flagged by the audit"
    if kinds:
        text += ": " + AuditReport.kinds_words(kinds)
    return text + (f" ({out['leaked_blocks']} leaked)" if out["leaked_blocks"] is not None and n else "")


def device_free(device: str) -> int | None:
    """What the device could still give at the end of the run (nvml, else the machine's available RAM)."""
    from kvscope.sysinfo import MemoryProbe

    return MemoryProbe.for_device(device).read().device_free


def _compare_caching(session, args: argparse.Namespace) -> int:
    """``--compare-caching``: the same requests through two engines on one set of weights."""
    if getattr(session, "engine", None) is None:
        session.close()
        return _fail("--compare-caching needs a live engine, not a trace replay", 2)
    sc = session.scenario.scenario if getattr(session, "scenario", None) else None
    prompts = [r["prompt"] for r in sc.requests if "prompt" in r] if sc else []
    prompts += args.inject + args.inject_ids
    if not prompts:
        session.close()
        return _fail("--compare-caching: no requests (give a --scenario with prompts, or --inject)", 2)
    max_tokens = max([r.get("max_tokens", 16) for r in sc.requests] if sc else [args.max_tokens])
    try:
        c = session.compare_caching(prompts, max_tokens)
    except ValueError as e:
        return _fail(one_line(e), 2)
    finally:
        session.close()
    out = {"requests": len(prompts), "divergence": None, "audit": c.audit}
    if c.divergence is not None:
        out["divergence"] = c.divergence.to_dict()
    print(json.dumps(out, indent=2) if args.json else c.summary())  # the window shows the same line
    return 0
