"""KV cache quantization: capacity, throughput and drift against the unquantized cache.

    python bench/kv_quant.py [--quick | --full]

On SmolLM2 (fp32 on the CPU here), for kv_cache_dtype auto / fp8 / int8 / int4 (V int4, K int8):
- capacity: blocks and tokens in one fixed budget (1 GiB), and the ratio against the same model's
  cache in 16 bits (what a GPU deployment would hold);
- throughput: 16 requests (128-token prompts, 64 output tokens) at once;
- drift, on prompts of 128, 1,024 and 4,096 tokens, 512 greedy tokens each: the unquantized
  engine generates the reference. A teacher-forced copy of each prompt in the quantized engine
  is fed the reference tokens (its KV is written token by token, as in serving) and the KL
  divergence KL(reference || quantized) of the next-token distribution is taken at every
  position; a free-running copy generates its own greedy tokens, compared with the reference
  over the first 32 / 128 / 512 (agreement, and the first position that differs). After the
  1,024- and 4,096-token prompts only 128 tokens are generated unless ``--full`` (CPU time).
"""

from __future__ import annotations

import time

import torch

from common import engine_for, main, model_for, pyplot, random_prompts, save_figure, table, write_results
from engine import SamplingParams
from engine.config import KV_CACHE_DTYPES
from engine.runner.kv_quant import part_formats, token_bytes

DTYPES = list(KV_CACHE_DTYPES)


class Recorder:
    """Wraps ``runner.sample``: forces tokens for some sequences and keeps their log-probs."""

    def __init__(self, engine, forced: dict[str, list[int]] | None = None) -> None:
        self.forced = forced or {}
        self.logprobs: dict[str, list[torch.Tensor]] = {}
        self.sample = engine.runner.sample
        engine.runner.sample = self

    def __call__(self, logits: torch.Tensor, reqs: list) -> list[int]:
        tokens = self.sample(logits, reqs)
        lp = torch.log_softmax(logits.float(), dim=-1)
        for i, r in enumerate(reqs):
            self.logprobs.setdefault(r.request_id, []).append(lp[i].cpu())
            ref = self.forced.get(r.request_id)
            if ref is not None:
                tokens[i] = ref[len(r.output_token_ids)]
        return tokens


def run_drift(mtn, dtype: str, prompts: list[list[int]], n_outs: list[int], reference: dict | None) -> dict:
    """One engine run per prompt (batching a 128-token context with a 4,096-token one would pad
    the short one's decode attention to the long one's length in the torch path)."""
    parts = [
        _drift_one(
            mtn,
            dtype,
            [p],
            n_outs[i],
            None if reference is None else {k: [v[i]] for k, v in reference.items() if k != "seconds"},
        )
        for i, p in enumerate(prompts)
    ]
    return {
        k: [x for part in parts for x in part[k]] if k != "seconds" else sum(part[k] for part in parts)
        for k in parts[0]
    }


def _drift_one(mtn, dtype: str, prompts: list[list[int]], n_out: int, reference: dict | None) -> dict:
    engine = engine_for(
        mtn, kv_cache_dtype=dtype, num_gpu_blocks=4096, max_model_len=8192, block_size=16, max_num_batched_tokens=2048
    )
    greedy = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    ids = {"free": [engine.add_request(p, greedy, request_id=f"free{i}") for i, p in enumerate(prompts)]}
    forced = {}
    if reference is not None:
        ids["forced"] = [engine.add_request(p, greedy, request_id=f"forced{i}") for i, p in enumerate(prompts)]
        forced = {f"forced{i}": reference["tokens"][i] for i in range(len(prompts))}
    rec = Recorder(engine, forced)
    t0 = time.perf_counter()
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step().finished:
            done[o.request_id] = o.outputs[0].token_ids
    seconds = time.perf_counter() - t0
    out = {"tokens": [done[r] for r in ids["free"]], "seconds": seconds}
    if reference is None:
        out["logprobs"] = [rec.logprobs[r] for r in ids["free"]]
        return out
    kls = []
    for i, rid in enumerate(ids["forced"]):
        ref_lp = torch.stack(reference["logprobs"][i])
        q_lp = torch.stack(rec.logprobs[rid])
        kls.append((ref_lp.exp() * (ref_lp - q_lp)).sum(-1).clamp_min(0).tolist())
    out["kl"] = kls
    return out


def agreement(ours: list[int], ref: list[int], n: int) -> float:
    return sum(a == b for a, b in zip(ours[:n], ref[:n])) / min(n, len(ref))


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)


def throughput(mtn, dtype: str, n: int, prompt_len: int, n_out: int) -> float:
    engine = engine_for(mtn, kv_cache_dtype=dtype, num_gpu_blocks=2048, max_model_len=4096)
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    for p in random_prompts([prompt_len] * n, mtn[0].config.vocab_size, seed=77):
        engine.add_request(p, params)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return n * n_out / (time.perf_counter() - t0)


def run(quick: bool, full: bool = False) -> dict:
    mtn = model_for(quick)
    cfg = mtn[0].config
    kvh = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    lengths, marks = ((16, 64), (8, 24)) if quick else ((128, 1024, 4096), (32, 128, 512))
    # 512 decode steps at a 1-4k context take minutes per dtype in the torch path on 2 CPU cores:
    # --full runs them all (19.8 min here); the default stops the longer prompts at 128 tokens.
    n_outs = [marks[-1] if (full or plen <= 128) else 128 for plen in lengths]
    prompts = random_prompts(list(lengths), cfg.vocab_size, seed=5)
    reference = run_drift(mtn, "auto", prompts, n_outs, None)
    budget = 1 << 30
    rows = []
    for dtype in DTYPES:
        engine = engine_for(mtn, kv_cache_dtype=dtype, kv_cache_memory_bytes=budget, block_size=16)
        fmts = part_formats(dtype)
        bytes32 = sum(token_bytes(f, kvh, head_dim, 4) for f in fmts)
        bytes16 = sum(token_bytes(f, kvh, head_dim, 2) for f in fmts)
        row = {
            "kv_cache_dtype": dtype,
            "blocks": engine.pool.num_blocks,
            "tokens": engine.pool.num_blocks * 16,
            "bytes_per_token_layer": bytes32,
            "x_fp32": sum(token_bytes("none", kvh, head_dim, 4) for _ in fmts) / bytes32,
            "x_16bit": sum(token_bytes("none", kvh, head_dim, 2) for _ in fmts) / bytes16,
            "tok_s": throughput(mtn, dtype, 4 if quick else 16, 16 if quick else 128, 8 if quick else 64),
        }
        del engine
        if dtype != "auto":
            d = run_drift(mtn, dtype, prompts, n_outs, reference)
            for i, plen in enumerate(lengths):
                ref_toks, ours = reference["tokens"][i], d["tokens"][i]
                for m in marks:
                    row[f"agree_{plen}_{m}"] = agreement(ours, ref_toks, m) if m <= n_outs[i] else None
                row[f"first_diff_{plen}"] = first_divergence(ours, ref_toks)
                kl = d["kl"][i]
                row[f"kl_mean_{plen}"] = sum(kl) / len(kl)
                row[f"kl_max_{plen}"] = max(kl)
                row[f"kl_{plen}"] = kl
        rows.append(row)
    result = {
        "model": mtn[2],
        "budget_bytes": budget,
        "prompt_lengths": list(lengths),
        "generated": n_outs,
        "marks": list(marks),
        "rows": rows,
    }
    name = "kv_quant_full" if full else "kv_quant"
    write_results(name, result, quick)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 3), sharey=True)
    for ax, plen in zip(axes, lengths):
        for r, c in zip(rows[1:], ("#c84", "#2a7", "#47c")):
            kl = torch.tensor(r[f"kl_{plen}"])
            w = max(1, len(kl) // 32)
            smooth = kl.unfold(0, w, w).mean(-1) if len(kl) >= w else kl
            ax.plot(range(0, w * len(smooth), w), smooth.tolist(), color=c, label=r["kv_cache_dtype"])
        ax.set_yscale("log")
        ax.set_title(f"{plen}-token prompt")
        ax.set_xlabel("generated position")
    axes[0].set_ylabel("KL(ref || quantized), nats")
    axes[0].legend()
    save_figure(fig, name, quick)
    print(
        table(
            rows,
            [
                ("kv_cache_dtype", "kv_cache_dtype", ""),
                ("blocks", "blocks in 1 GiB", "d"),
                ("x_fp32", "x fp32 cache", ".2f"),
                ("x_16bit", "x 16-bit cache", ".2f"),
                ("tok_s", "tok/s", ".1f"),
            ],
        )
    )
    cols = [("kv_cache_dtype", "kv_cache_dtype", "")]
    for plen in lengths:
        cols += [(f"agree_{plen}_{m}", f"{plen}: agree@{m}", ".0%") for m in marks if m <= n_outs[lengths.index(plen)]]
        cols += [(f"kl_mean_{plen}", f"{plen}: mean KL", ".2e")]
    print(table(rows[1:], cols))
    return result


if __name__ == "__main__":
    import sys

    full = "--full" in sys.argv
    if full:
        sys.argv.remove("--full")
    main(lambda quick: run(quick, full), __doc__)
