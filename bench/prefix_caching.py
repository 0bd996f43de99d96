"""Prefix caching: time to first token and throughput with the cache on and off.

    python bench/prefix_caching.py [--quick]

Two workloads on SmolLM2, each run with caching on and off:
- shared system prompt: a 1,500-token system prompt plus a 100-300 token user turn per request,
  16 output tokens. One client (each request arrives when the previous one finished: TTFT is
  the prefill latency), then all requests at once (throughput);
- a 10-turn chat: each turn sends the whole conversation so far (earlier answers included)
  plus a 100-300 token user message.
TTFT p50/p99, requests/s, output tokens/s and the hit rate (prefix_cache_hits / queries).
"""

from __future__ import annotations

import time

from common import (
    engine_for,
    length_mix,
    main,
    model_for,
    percentile,
    pyplot,
    random_prompts,
    save_figure,
    table,
    write_results,
)
from engine import SamplingParams


def ttft_sequential(engine, prompts, max_tokens) -> tuple[list[float], float, list[list[int]]]:
    """Send each prompt alone; returns TTFTs, total seconds and the outputs."""
    ttfts, outs = [], []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t_all = time.perf_counter()
    for p in prompts:
        rid = engine.add_request(p, params)
        t0 = time.perf_counter()
        first = None
        while engine.has_unfinished():
            for o in engine.step().outputs:
                if o.request_id == rid and first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if o.finished:
                    outs.append(o.outputs[0].token_ids)
        ttfts.append(first)
    return ttfts, time.perf_counter() - t_all, outs


def concurrent(engine, prompts, max_tokens) -> tuple[float, list[float]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = {engine.add_request(p, params): None for p in prompts}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if ids.get(o.request_id) is None and o.outputs[0].token_ids:
                ids[o.request_id] = time.perf_counter() - t0
    return time.perf_counter() - t0, list(ids.values())


def hit_rate(engine) -> float:
    m = engine.metrics()
    return m["prefix_cache_hits"] / m["prefix_cache_queries"] if m["prefix_cache_queries"] else 0.0


def run(quick: bool) -> dict:
    mtn = model_for(quick)
    vocab = mtn[0].config.vocab_size
    sys_len, n_req, turns, max_tokens = (200, 4, 4, 4) if quick else (1500, 8, 10, 16)
    user_lens = [p for p, _ in length_mix(n_req, 3, (100, 300), (1, 1))]
    system = random_prompts([sys_len], vocab, seed=7)[0]
    prompts = [system + u for u in random_prompts(user_lens, vocab, seed=8)]
    chat_turns = random_prompts([p for p, _ in length_mix(turns, 4, (100, 300), (1, 1))], vocab, seed=9)
    rows = []
    for caching in (False, True):
        kw = dict(enable_prefix_caching=caching, max_model_len=4096 if quick else 8192, num_gpu_blocks=2048)
        engine = engine_for(mtn, **kw)
        warm = SamplingParams(max_tokens=1, temperature=0.0)
        engine.add_request(random_prompts([16], vocab, 1)[0], warm)
        while engine.has_unfinished():
            engine.step()
        engine.reset_prefix_cache()
        ttfts, seq_s, _ = ttft_sequential(engine, prompts, max_tokens)
        shared_hits = hit_rate(engine)
        engine.reset_prefix_cache()
        conc_s, conc_ttft = concurrent(engine, prompts, max_tokens)
        engine.reset_prefix_cache()
        q0, h0 = engine.kv.prefix_cache_queries, engine.kv.prefix_cache_hits
        conv: list[int] = []
        chat_ttft = []
        t0 = time.perf_counter()
        for user in chat_turns:
            conv = conv + user
            t, _, outs = ttft_sequential(engine, [conv], max_tokens)
            chat_ttft.append(t[0])
            conv = conv + outs[0]
        chat_s = time.perf_counter() - t0
        q, h = engine.kv.prefix_cache_queries - q0, engine.kv.prefix_cache_hits - h0
        rows.append(
            {
                "caching": "on" if caching else "off",
                "ttft_p50_s": percentile(ttfts, 50),
                "ttft_p99_s": percentile(ttfts, 99),
                "sequential_req_s": n_req / seq_s,
                "concurrent_out_tok_s": n_req * max_tokens / conc_s,
                "concurrent_ttft_p50_s": percentile(conc_ttft, 50),
                "shared_hit_rate": shared_hits,
                "chat_ttft_p50_s": percentile(chat_ttft, 50),
                "chat_ttft_last_s": chat_ttft[-1],
                "chat_ttft_per_turn_s": chat_ttft,
                "chat_seconds": chat_s,
                "chat_hit_rate": h / q if q else 0.0,
            }
        )
    off, on = rows
    speedup = {k: off[k] / on[k] for k in ("ttft_p50_s", "ttft_p99_s", "chat_ttft_p50_s", "chat_ttft_last_s")}
    speedup["sequential_req_s"] = on["sequential_req_s"] / off["sequential_req_s"]
    speedup["concurrent_out_tok_s"] = on["concurrent_out_tok_s"] / off["concurrent_out_tok_s"]
    result = {
        "model": mtn[2],
        "system_prompt_tokens": sys_len,
        "requests": n_req,
        "chat_turns": turns,
        "max_tokens": max_tokens,
        "rows": rows,
        "speedup_with_caching": speedup,
    }
    write_results("prefix_caching", result, quick)
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
    ax[0].bar(
        ["p50 off", "p50 on", "p99 off", "p99 on"],
        [off["ttft_p50_s"], on["ttft_p50_s"], off["ttft_p99_s"], on["ttft_p99_s"]],
        color=["#888", "#2a7", "#888", "#2a7"],
    )
    ax[0].set_ylabel("TTFT, s")
    ax[0].set_title(f"{sys_len}-token shared system prompt")
    for r, c in ((off, "#888"), (on, "#2a7")):
        ax[1].plot(range(1, turns + 1), r["chat_ttft_per_turn_s"], "o-", color=c, label=f"caching {r['caching']}")
    ax[1].set_xlabel("chat turn")
    ax[1].set_ylabel("TTFT, s")
    ax[1].legend()
    ax[1].set_title(f"{turns}-turn chat")
    save_figure(fig, "prefix_caching", quick)
    print(
        table(
            rows,
            [
                ("caching", "caching", ""),
                ("ttft_p50_s", "TTFT p50 s", ".3f"),
                ("ttft_p99_s", "TTFT p99 s", ".3f"),
                ("sequential_req_s", "req/s (one client)", ".2f"),
                ("concurrent_out_tok_s", "out tok/s (all at once)", ".1f"),
                ("shared_hit_rate", "hit rate", ".0%"),
                ("chat_ttft_p50_s", "chat TTFT p50 s", ".3f"),
                ("chat_ttft_last_s", "chat TTFT last turn s", ".3f"),
                ("chat_hit_rate", "chat hit rate", ".0%"),
            ],
        )
    )
    print("with caching: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedup.items()))
    return result


if __name__ == "__main__":
    main(run, __doc__)
