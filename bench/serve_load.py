"""Serving under load, with clients that leave: nothing may leak, nothing may be lost or doubled.

    python bench/serve_load.py [--quick]

The tiny random Llama behind the OpenAI-compatible server (uvicorn on its thread, the session
stepped on another, as ``kvscope --headless --serve`` runs it), a pool small enough that requests
preempt each other (80 blocks of 16 tokens for 16 requests of up to 224 tokens; ``--quick``: 32),
prompts with shared prefixes (prefix-cache hits). 200 requests from 16 concurrent clients
(``--quick``: 40 from 8); 70% stream, 30% do not; 20% disconnect at a random point (a streaming
one after a random number of chunks, from 0; a non-streaming one after a random delay).
Checked: every request that stayed got exactly one complete answer whose token ids equal
``LLM.generate``'s for its prompt (greedy); every abort was carried out before the engine's
next step; at the end ``audit()`` is clean, no request is left and every block is free or
cached-free. Reported: requests/s, output tokens/s, TTFT (streaming) and end-to-end latency p50/p99.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from common import engine_for, main, percentile, random_prompts, table, tiny_model, write_results
from engine import LLM, SamplingParams
from engine.inspect.snapshot import BlockState
from kvscope.runtime.loop import HostLoop
from kvscope.serve import OpenAIServer, ServeOptions
from kvscope.sources.live import LiveSource

ENGINE = dict(block_size=16, num_gpu_blocks=80, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024)


@dataclass
class Plan:
    prompt: list[int]
    max_tokens: int
    stream: bool
    leave_after_chunks: int | None = None  # streaming: disconnect after this many chunks
    leave_after_s: float | None = None  # non-streaming: disconnect after this long


@dataclass
class Outcome:
    status: str  # "done", "left", "error"
    token_ids: list[int] | None = None
    finish_reasons: int = 0  # how many chunks carried a finish reason (one, for a complete answer)
    dones: int = 0  # how many [DONE] markers
    ttft: float | None = None
    e2e: float | None = None
    error: str = ""


def make_plans(n: int, seed: int, max_out: int, vocab: int | None = None) -> list[Plan]:
    rng = random.Random(seed)
    vocab = vocab or tiny_model()[0].config.vocab_size
    prefixes = [random_prompts([k], vocab, seed + k)[0] for k in (0, 32, 64)]
    plans = []
    for i in range(n):
        prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
        tail = random_prompts([rng.randint(4, 96)], vocab, seed * 1000 + i)[0]
        p = Plan(prefix + tail, rng.randint(4, max_out), rng.random() < 0.7)
        if rng.random() < 0.2:
            if p.stream:
                p.leave_after_chunks = rng.randint(0, p.max_tokens - 1)
            else:
                p.leave_after_s = rng.uniform(0.005, 0.4)
        plans.append(p)
    return plans


async def one_request(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    body = {
        "prompt": plan.prompt,
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "stream": plan.stream,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    if not plan.stream:
        try:
            r = await asyncio.wait_for(client.post("/v1/completions", json=body), plan.leave_after_s)
        except asyncio.TimeoutError:
            return Outcome("left")
        if r.status_code != 200:
            return Outcome("error", error=f"{r.status_code} {r.text[:200]}")
        choice = r.json()["choices"][0]
        return Outcome(
            "done", choice["token_ids"], int(choice["finish_reason"] is not None), 1, None, time.perf_counter() - t0
        )
    out = Outcome("done", [])
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return Outcome("error", error=f"{r.status_code} {(await r.aread())[:200]!r}")
        chunks = 0
        if plan.leave_after_chunks == 0:
            return Outcome("left")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                out.dones += 1
                continue
            ev = json.loads(data)
            if "error" in ev:
                return Outcome("error", error=str(ev["error"]))
            choice = ev["choices"][0]
            if out.ttft is None and choice["token_ids"]:
                out.ttft = time.perf_counter() - t0
            out.token_ids += choice["token_ids"]
            out.finish_reasons += choice["finish_reason"] is not None
            chunks += 1
            if plan.leave_after_chunks is not None and chunks >= plan.leave_after_chunks:
                return Outcome("left")  # leaving the block closes the connection mid-stream
    out.e2e = time.perf_counter() - t0
    return out


async def drive(url: str, plans: list[Plan], clients: int) -> tuple[list[Outcome], float]:
    todo = list(enumerate(plans))
    results: list[Outcome | None] = [None] * len(plans)

    async def client_loop() -> None:
        # One connection per client; a disconnect drops it and the next request opens another.
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while todo:
                i, plan = todo.pop(0)
                try:
                    results[i] = await one_request(client, plan)
                except Exception as e:  # noqa: BLE001 - a lost answer is a result, not a crash
                    results[i] = Outcome("error", error=f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return results, time.perf_counter() - t0  # type: ignore[return-value]


def run(quick: bool) -> dict:
    n, clients, max_out = (40, 8, 24) if quick else (200, 16, 64)
    config = {**ENGINE, "num_gpu_blocks": 32} if quick else ENGINE  # smaller requests, smaller pool: preemption
    row = serve_under_load(lambda: engine_for(tiny_model(), **config), make_plans(n, seed=0, max_out=max_out), clients)
    print(
        table(
            [row],
            [
                ("requests", "requests", "d"),
                ("clients", "clients", "d"),
                ("stayed", "stayed", "d"),
                ("left", "left", "d"),
                ("aborts", "aborts", "d"),
                ("lost", "lost", "d"),
                ("doubled", "doubled", "d"),
                ("wrong_outputs", "wrong", "d"),
                ("leaked_blocks", "leaked", "d"),
                ("req_s", "req/s", ".1f"),
                ("out_tok_s", "out tok/s", ".0f"),
                ("ttft_p50_s", "TTFT p50 s", ".3f"),
                ("ttft_p99_s", "TTFT p99 s", ".3f"),
                ("e2e_p50_s", "e2e p50 s", ".3f"),
                ("e2e_p99_s", "e2e p99 s", ".3f"),
            ],
        )
    )
    if row["errors_text"]:
        print("errors:", *row["errors_text"], sep="\n  ")
    result = {"config": config, "rows": [row]}
    write_results("serve_load", result, quick)
    return result


def serve_under_load(make_engine, plans: list[Plan], clients: int) -> dict:
    """The server over ``make_engine()``'s engine under ``plans`` from ``clients`` clients; the oracle is a
    second ``make_engine()`` engine's ``LLM.generate``. Returns the row of figures."""
    n = len(plans)
    engine = make_engine()
    server = OpenAIServer(ServeOptions(port=0))
    session = LiveSource(engine)
    server.start()
    loop = HostLoop.over(session, server.bridge)  # loaded: the bridge attached, serving
    loop.start()
    try:
        outcomes, seconds = asyncio.run(drive(server.url, plans, clients))
        t0 = time.monotonic()
        while loop.call(session.has_work):  # the last aborts and answers
            if time.monotonic() - t0 > 60:
                raise RuntimeError("the engine did not go idle")
            time.sleep(0.01)
        audit = loop.call(engine.audit)
        snap = loop.call(engine.snapshot)
        counters = loop.call(engine.metrics)
        live = loop.call(lambda: len(engine.requests))
        metrics_text = httpx.get(f"{server.url}/metrics").text
        aborts = list(server.bridge.abort_log)
    finally:
        loop.call(lambda: server.bridge.detach("benchmark over"))
        server.stop()
        loop.join()

    stayed = [(p, o) for p, o in zip(plans, outcomes) if o.status == "done"]
    left = sum(o.status == "left" for o in outcomes)
    errors = [o.error for o in outcomes if o.status == "error"]
    # The oracle: the same prompts, greedy, through LLM.generate on a fresh engine.
    ref = LLM.from_engine(make_engine()).generate(
        [p.prompt for p, _ in stayed], [SamplingParams(max_tokens=p.max_tokens, temperature=0.0) for p, _ in stayed]
    )
    wrong = sum(o.token_ids != r.outputs[0].token_ids for (_, o), r in zip(stayed, ref))  # lost or doubled tokens
    incomplete = sum(o.finish_reasons < 1 or o.dones < 1 for _, o in stayed)
    doubled = sum(o.finish_reasons > 1 or o.dones > 1 for _, o in stayed)
    # Every request is over: a block still referenced, or a CPU block still holding a swap, is a leak.
    leaked = int((snap.ref_cnt != 0).sum()) + int((snap.cpu_state == BlockState.SWAPPED).sum())
    ttft = [o.ttft for _, o in stayed if o.ttft is not None]
    e2e = [o.e2e for _, o in stayed]
    out_tokens = sum(len(o.token_ids) for _, o in stayed)
    row = {
        "requests": n,
        "clients": clients,
        "stayed": len(stayed),
        "left": left,
        "errors": len(errors),
        "aborts": len(aborts),
        "aborts_not_admitted": sum(not a.admitted for a in aborts),
        "max_abort_delay_steps": max((a.done_after - a.requested_after for a in aborts), default=0),
        "wrong_outputs": wrong,
        "lost": len(errors) + incomplete,
        "doubled": doubled,
        "leaked_blocks": leaked,
        "audit_ok": audit.ok,
        "requests_left_in_engine": live,
        "preemptions": counters["num_preemptions"],
        "prefix_hit_rate": counters["prefix_cache_hits"] / max(counters["prefix_cache_queries"], 1),
        "seconds": seconds,
        "req_s": len(stayed) / seconds,
        "out_tok_s": out_tokens / seconds,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "steps": counters["step"],
        "metrics_generation_tokens_ok": f'vllm:generation_tokens_total{{engine="0",model_name="{engine.model_name}"}} '
        f"{float(counters['generation_tokens'])}" in metrics_text,
        "errors_text": errors[:5],
    }
    return row


if __name__ == "__main__":
    main(run, __doc__)
