"""Soak: thousands of requests under pressure, audited after every step; with ``--faults``, failing too.

    python bench/soak.py [--requests 5000] [--seed 0]            # pressure only
    python bench/soak.py --faults [--requests 5000] [--seed 0]   # pressure and injected failures

On the tiny random Llama, a small pool (48 blocks of 4 tokens) and a small CPU swap pool, so
preemption (by recompute, by swap, and swap falling back to recompute), eviction and
copy-on-write happen all the time. Requests arrive at random with random shared prefixes and
lengths, n = 1-3 and some beam searches; random aborts hit requests waiting, mid-prefill,
mid-decode and swapped. Half the requests run with preemption_mode="recompute", half with "swap".

With faults, the model step, the sampler and each kind of device copy (swap-out, swap-in,
copy-on-write) fail at random, each after writing noise where its output should have gone (a
forward dying half-way, a copy dying half-way), so any KV the engine wrongly kept would show.

Checked: ``audit()`` clean and the replayed event stream equal to the live pool after every
step; at the end every block (device and CPU) is free and every sequence ended exactly once; a
fixed-seed greedy subset, never aborted, is token-identical to the same prompts run without
pressure or faults (each one that a fault did not fail). ``run_soak`` is also the CI test.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from collections import Counter

import torch

from common import engine_for, tiny_model, write_results
from engine import LLM, SamplingParams
from engine.core.request import RequestStatus
from engine.inspect.events import (
    LeakFound,
    RequestAborted,
    RequestAdmitted,
    RequestFinished,
    RequestForked,
    RequestPreempted,
)
from engine.inspect.replay import PoolReplayer

FAULT_KINDS = ("model", "sampler", "swap_out", "swap_in", "copy_on_write")
# Per call that has work to do. Copies are rarer than steps, so they fail more often per call.
FAULT_RATES = {"model": 0.01, "sampler": 0.01, "swap_out": 0.08, "swap_in": 0.08, "copy_on_write": 0.05}


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    """Wraps the runner's model step, sampler and device copies; each fails at its rate, after noise."""

    def __init__(self, runner, rng: random.Random, rates: dict[str, float]) -> None:
        self.runner, self.rng, self.rates = runner, rng, rates
        self.injected: Counter[str] = Counter()
        self.noise = torch.Generator().manual_seed(rng.randrange(2**31))
        for kind, name in (
            ("model", "execute"),
            ("sampler", "sample"),
            ("swap_out", "swap_out_blocks"),
            ("swap_in", "swap_in_blocks"),
            ("copy_on_write", "copy_on_write"),
        ):
            setattr(runner, name, self._wrap(kind, getattr(runner, name)))

    def _fire(self, kind: str) -> bool:
        if self.rng.random() >= self.rates.get(kind, 0.0):
            return False
        self.injected[kind] += 1
        return True

    def _scribble(self, cache: torch.Tensor, index: torch.Tensor) -> None:
        cache[index] = (torch.randn(cache[index].shape, generator=self.noise) * 50).to(cache.dtype)

    def _wrap(self, kind: str, real):
        r = self.runner
        if kind == "model":

            def execute(sched):
                if self._fire("model"):
                    bs = r.block_size
                    slots = [
                        s.block_ids[p // bs] * bs + p % bs
                        for s in sched.scheduled
                        for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
                    ]
                    for pair in r.kv_caches:
                        for cache in pair:
                            self._scribble(cache.view(-1, *cache.shape[2:]), torch.tensor(slots))
                    raise InjectedFault("model step")
                return real(sched)

            return execute
        if kind == "sampler":

            def sample(logits, reqs):
                if self._fire("sampler"):
                    raise InjectedFault("sampler")
                return real(logits, reqs)

            return sample

        def copy(pairs):
            if self._fire(kind):
                dst = torch.tensor([b for _, b in pairs])
                for pair in r.cpu_caches if kind == "swap_out" else r.kv_caches:
                    for cache in pair:
                        self._scribble(cache, dst)
                raise InjectedFault(kind)
            return real(pairs)

        return copy


def _abort_category(engine, rid: str) -> str:
    r = engine.requests.get(rid) or next((m for m in engine.groups.get(rid, []) if not m.is_finished), None)
    if r is None:
        return "finished"
    if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        return "waiting"
    if r.status == RequestStatus.SWAPPED:
        return "swapped"
    return "mid-prefill" if r.num_computed_tokens < r.num_prompt_tokens else "mid-decode"


def run_soak(
    num_requests: int, seed: int = 0, mode: str = "recompute", num_blocks: int = 48, faults: bool = False
) -> dict:
    log = logging.getLogger("engine")
    level = log.level
    if faults:
        log.setLevel(logging.CRITICAL)  # each injected failure would log its traceback
    try:
        return _run_soak(num_requests, seed, mode, num_blocks, faults)
    finally:
        log.setLevel(level)


def _run_soak(num_requests: int, seed: int, mode: str, num_blocks: int, faults: bool) -> dict:
    rng = random.Random(seed)
    mtn = tiny_model()
    vocab = mtn[0].config.vocab_size
    engine = engine_for(
        mtn,
        block_size=4,
        num_gpu_blocks=num_blocks,
        num_cpu_blocks=24,
        preemption_mode=mode,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=256,
    )
    injector = FaultInjector(engine.runner, random.Random(seed + 7919), FAULT_RATES) if faults else None
    replayer = PoolReplayer(engine.pool.num_blocks)
    prefixes = [[rng.randrange(1, vocab) for _ in range(n)] for n in (0, 8, 16, 24)]
    greedy_every = max(1, min(num_requests // 20, 10))  # at least 20 protected greedy requests; 1 in 10 in long runs
    greedy: dict[str, tuple[list[int], int]] = {}  # protected requests: prompt, max_tokens
    outputs: dict[str, list[int]] = {}
    failed: set[str] = set()  # user requests a fault failed
    terminal: Counter[str] = Counter()
    sequences: set[str] = set()
    aborts: Counter[str] = Counter()
    preempt_modes: Counter[str] = Counter()
    leaks = failed_steps = recomputed_after_failed_swap = sequences_failed = 0
    added = refused = 0
    t0 = time.perf_counter()
    while added < num_requests or engine.has_unfinished():
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2)) if added < num_requests else 0):
            # Some prompts exceed the step's token budget (64), so they prefill in chunks.
            tail = rng.randint(60, 140) if rng.random() < 0.15 else rng.randint(1, 30)
            prompt = rng.choice(prefixes) + [rng.randrange(1, vocab) for _ in range(tail)]
            max_tokens = rng.randint(1, 24)
            if added % greedy_every == 0:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            elif rng.random() < 0.05:
                params = SamplingParams(max_tokens=max_tokens, use_beam_search=True, beam_width=2, ignore_eos=True)
            else:
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=rng.choice((0.0, 0.8)),
                    n=rng.choice((1, 1, 1, 2, 3)),
                    seed=rng.randrange(1000),
                    ignore_eos=True,
                )
            before = len(engine.requests)
            try:
                rid = engine.add_request(prompt, params)
            except ValueError:  # e.g. two beams of a long prompt cannot fit this small pool: refused
                refused += 1
                assert len(engine.requests) == before  # and nothing else changed
                continue
            sequences.add(rid)
            if added % greedy_every == 0:
                greedy[rid] = (prompt, max_tokens)
            added += 1
        if rng.random() < 0.08 and engine.requests:
            # Half the aborts aim at sequences on the device (mid-prefill, mid-decode), which the
            # long waiting queue would otherwise outnumber.
            u = rng.random()
            pool = (
                engine.scheduler.running
                if u < 0.4
                else engine.scheduler.swapped
                if u < 0.6
                else engine.requests.values()
            )
            live = sorted({r.group_id for r in pool} - set(greedy)) or sorted(
                {r.group_id for r in engine.requests.values()} - set(greedy)
            )
            if live:
                rid = rng.choice(live)
                aborts[_abort_category(engine, rid)] += 1
                engine.abort(rid)
        out = engine.step()
        failed_steps += out.error is not None
        report = engine.audit(emit_events=True)
        if not report.ok:
            raise AssertionError(f"step {engine.step_count}: {report}")
        events = out.events + engine.ledger.drain_events()
        replayer.apply_all(events)
        pool = engine.pool
        if (
            replayer.ref_cnt.tolist() != [b.ref_cnt for b in pool.blocks]
            or list(replayer.free_queue) != pool.free_queue.ids()
            or replayer.block_hash != [b.block_hash.hex() if b.block_hash else None for b in pool.blocks]
        ):
            raise AssertionError(f"step {engine.step_count}: the replayed event stream differs from the pool")
        for ev in events:
            if isinstance(ev, (RequestFinished, RequestAborted)):
                terminal[ev.request_id] += 1
                sequences_failed += isinstance(ev, RequestFinished) and ev.reason == "error"
            elif isinstance(ev, RequestPreempted):
                preempt_modes[ev.mode] += 1
                recomputed_after_failed_swap += "swap-out" in ev.reason
            elif isinstance(ev, LeakFound):
                leaks += 1
            elif isinstance(ev, RequestAdmitted):
                sequences.add(ev.request_id)
            elif isinstance(ev, RequestForked):
                sequences.add(ev.child_id)
        for o in out.outputs:
            if o.finished and o.error:
                failed.add(o.request_id)
            elif o.finished and o.request_id in greedy:
                outputs[o.request_id] = o.outputs[0].token_ids
    seconds = time.perf_counter() - t0
    twice = [rid for rid, n in terminal.items() if n != 1] + [rid for rid in sequences if terminal[rid] == 0]
    assert not twice, f"sequences not ended exactly once: {twice[:10]}"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, "blocks still held at the end"
    assert engine.kv.cpu_pool.num_free_blocks == engine.kv.cpu_pool.num_blocks, "CPU blocks still held"
    # The protected greedy subset, against the same prompts without pressure (and without faults).
    checked = {rid: v for rid, v in greedy.items() if rid not in failed}
    calm = LLM.from_engine(engine_for(mtn, block_size=4, num_gpu_blocks=4096, max_model_len=256))
    ref = calm.generate(
        [p for p, _ in checked.values()],
        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in checked.values()],
    )
    mismatched = [rid for rid, r in zip(checked, ref) if outputs.get(rid) != r.outputs[0].token_ids]
    assert not mismatched, f"greedy outputs changed under pressure: {mismatched}"
    m = engine.metrics()
    return {
        "mode": mode,
        "faults": faults,
        "requests": added,
        "refused": refused,
        "sequences": len(sequences),
        "steps": engine.step_count,
        "aborts": sum(aborts.values()),
        "aborts_by_state": dict(aborts),
        "preemptions": m["num_preemptions"],
        "preemptions_by_mode": dict(preempt_modes),
        "swap_outs": m["swap_outs"],
        "swap_ins": m["swap_ins"],
        "cow_copies": m["cow_copies"],
        "evictions": m["evictions"],
        "leaks_found": leaks,
        "faults_by_kind": {k: injector.injected[k] for k in FAULT_KINDS} if injector else {},
        "failed_steps": failed_steps,
        "requests_failed": len(failed),
        "sequences_failed": sequences_failed,
        "recomputed_after_failed_swap_out": recomputed_after_failed_swap,
        "greedy_checked": len(checked),
        "greedy_failed": len(greedy) - len(checked),
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--faults",
        action="store_true",
        help="also fail the model step, the sampler and each kind of device copy at random",
    )
    args = ap.parse_args()
    rows = [
        run_soak(args.requests // 2, args.seed, "recompute", faults=args.faults),
        run_soak(args.requests - args.requests // 2, args.seed + 1, "swap", faults=args.faults),
    ]
    write_results("soak_faults" if args.faults else "soak", {"rows": rows}, quick=False)
    keys = [
        "requests",
        "refused",
        "sequences",
        "steps",
        "aborts",
        "preemptions",
        "swap_outs",
        "swap_ins",
        "cow_copies",
        "evictions",
        "leaks_found",
        "greedy_checked",
        "seconds",
    ]
    if args.faults:
        keys[-1:-1] = ["failed_steps", "requests_failed", "recomputed_after_failed_swap_out", "greedy_failed"]
    print("| mode | " + " | ".join(keys) + " | aborts by state |" + (" faults by kind |" if args.faults else ""))
    print("|---" * (len(keys) + 2 + args.faults) + "|")
    for r in rows:
        cells = [f"{r[k]:.0f}" if k == "seconds" else str(r[k]) for k in keys]
        print(
            f"| {r['mode']} | "
            + " | ".join(cells)
            + f" | {r['aborts_by_state']} |"
            + (f" {r['faults_by_kind']} |" if args.faults else "")
        )


if __name__ == "__main__":
    main()
