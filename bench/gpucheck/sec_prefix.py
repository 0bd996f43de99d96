"""Section prefix: time to first token of a 4,096-token prompt, cold, then again with its prefix cached.

Random Llama-2-7B weights in fp16 (a context of 8,192 so that the prompt and its answer fit), the whole
prompt in one step (``max_num_batched_tokens`` 8,192). Cold: nothing cached (after a warm-up prompt of
the same length, so that kernel compilation is not counted). Cached: the same prompt again; every full
block but the last is a hit, and the engine computes what is left (at least the last token).
"""

from __future__ import annotations

import time

import torch

from .shared import Ctx, Section, Table, random_native, sync


def ttft(engine, prompt: list[int], dev) -> tuple[float, int]:
    """Seconds from ``add_request`` to the first token, and the prompt tokens the cache served."""
    from engine import SamplingParams

    sync(dev)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if first is None and o.request_id == rid and o.outputs[0].token_ids:
                sync(dev)
                first = time.perf_counter() - t0
    return first, engine.kv.prefix_cache_hits


def run(ctx: Ctx, section: Section) -> None:
    from engine import LLMEngine

    dev = ctx.device
    n = ctx.n(4096, 200)
    model = random_native(ctx.big, ctx.dtype, dev)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, 2 * n)  # rotary has no limit
    engine = LLMEngine.from_model(
        model,
        None,
        name="random llama-2-7b",
        block_size=16,
        max_num_seqs=4,
        max_model_len=2 * n,
        max_num_batched_tokens=2 * n,
        num_gpu_blocks=4 * (2 * n // 16),
    )
    g = torch.Generator().manual_seed(11)
    vocab = engine.vocab_size
    warm = torch.randint(1, vocab, (n,), generator=g).tolist()
    ttft(engine, warm, dev)  # compiles the prefill kernels at this length
    prompt = torch.randint(1, vocab, (n,), generator=g).tolist()
    hits0 = engine.kv.prefix_cache_hits
    cold, hits1 = ttft(engine, prompt, dev)
    warm_s, hits2 = ttft(engine, prompt, dev)
    cached_tokens = hits2 - hits1  # the manager counts hits in tokens, as vLLM does
    section.tables.append(
        Table(
            f"Time to first token of one {n}-token prompt (random Llama-2-7B weights, fp16)",
            [("run", "run", ""), ("ttft_ms", "TTFT ms", ",.1f"), ("cached", "prompt tokens from the cache", ",d")],
            [
                {"run": "cold (nothing cached)", "ttft_ms": cold * 1e3, "cached": hits1 - hits0},
                {"run": "the same prompt again", "ttft_ms": warm_s * 1e3, "cached": cached_tokens},
            ],
        )
    )
    section.data.update(cold_s=cold, cached_s=warm_s, cached_tokens=cached_tokens, tokens=n)
    section.check("cached prompt tokens", cached_tokens, f">= {n - 16}", cached_tokens >= n - 16)
    section.check(
        "TTFT cached / cold", f"{warm_s / cold:.2f}", "<= 0.5 (halved, at least)", warm_s <= 0.5 * cold, hard=False
    )
