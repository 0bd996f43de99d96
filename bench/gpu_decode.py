"""Decode speed on a GPU: the engine against transformers' generate, and the memory bandwidth it reaches.

    python bench/gpu_decode.py [--model PATH] [--batches 1 16 64] [--prompt-len 128] [--max-tokens 128]

Without --model it builds a random-weight model of Llama-2-7B's shapes in fp16 (no download).
Decode steps are timed alone (after every prompt is prefilled); the achieved bandwidth is the
bytes a step must read (all weights + the KV of every context) over the step time, as a
fraction of the card's peak. Also prints the greedy agreement with transformers (random
weights give near-uniform logits, so fp16 rounding flips some argmaxes: it is reported, not
asserted; the exactness checks are the fp32 tests). ``--device cpu --shape tiny`` runs the
same code on a CPU (a smoke test; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine import LLMEngine, SamplingParams
from engine.runner.memory import weights_bytes

# Peak HBM bandwidth (GB/s) of common cards; --peak-gbs overrides.
PEAK_GBS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
    "RTX 4090": 1008,
    "RTX 3090": 936,
    "A10": 600,
    "T4": 320,
}

SHAPES = {
    "llama-2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
}


def peak_gbs(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((v for k, v in PEAK_GBS.items() if k.lower() in name.lower()), None)


def build_model(args, device: torch.device):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float16, device_map=str(device)).eval()
    cfg = LlamaConfig(**SHAPES[args.shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {}
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()) or engine.scheduler.waiting
    ):
        for o in engine.step().outputs:
            outs[o.request_id] = o.outputs[0].token_ids
    sync(engine.device)
    steps, kv_tokens = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        kv_tokens += sum(r.num_tokens for r in engine.scheduler.running)
        for o in engine.step().outputs:
            outs[o.request_id] = o.outputs[0].token_ids
        steps += 1
    sync(engine.device)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "steps": steps, "kv_tokens_read": kv_tokens, "tokens": [list(outs[i]) for i in ids]}


def hf_decode(model, prompts: list[list[int]], max_tokens: int, device: torch.device) -> dict:
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=2, do_sample=False)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            min_new_tokens=max_tokens,
        )
        sync(device)
    return {"seconds": time.perf_counter() - t0, "tokens": out[:, ids.shape[1] :].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a local folder (fp16); default: random Llama-2-7B shapes")
    ap.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--peak-gbs", type=float, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_decode.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    model = build_model(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_gbs(name, args.peak_gbs) if device.type == "cuda" else None
    max_batch = max(args.batches)
    t0 = time.perf_counter()
    max_model_len = args.prompt_len + args.max_tokens + 16
    # A pool just big enough for the largest batch: transformers' generate runs on the same card after
    # each engine run, and a pool sized to 90% of it (the engine's default) leaves it no room.
    block_size = 16
    num_blocks = max_batch * -(-max_model_len // block_size) + 8
    engine = LLMEngine.from_hf_model(
        model,
        None,
        name=args.model or f"random {args.shape}",
        max_num_seqs=max_batch,
        enforce_eager=args.enforce_eager,
        max_model_len=max_model_len,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
    )
    setup_s = time.perf_counter() - t0
    w_bytes = weights_bytes(engine.runner.model)
    kv_token_bytes = engine.runner.block_bytes // engine.config.block_size
    g = torch.Generator().manual_seed(1)
    vocab = engine.vocab_size
    rows = []
    for b in args.batches:
        prompts = torch.randint(1, vocab, (b, args.prompt_len), generator=g).tolist()
        eng = engine_decode(engine, prompts, args.max_tokens)
        hf = hf_decode(model, prompts, args.max_tokens, device)
        step_s = eng["seconds"] / max(eng["steps"], 1)
        read = w_bytes * eng["steps"] + kv_token_bytes * eng["kv_tokens_read"]
        gbs = read / eng["seconds"] / 1e9
        k = min(32, args.max_tokens)
        agree = sum(a == h for ea, ha in zip(eng["tokens"], hf["tokens"]) for a, h in zip(ea[:k], ha[:k]))
        n_new = b * (args.max_tokens - 1)  # decode steps produce all but the first token
        rows.append(
            {
                "batch": b,
                "engine_tok_s": n_new / eng["seconds"],
                "step_ms": step_s * 1e3,
                "hf_tok_s": b * args.max_tokens / hf["seconds"],
                "achieved_gbs": gbs,
                "bandwidth_fraction": gbs / peak if peak else None,
                "greedy_agreement_first32": agree / (k * b),
            }
        )
    label = args.model or f"random {args.shape}"
    print(
        f"device: {name}; model: {label} {engine.runner.dtype}; weights {w_bytes / 2**30:.2f} GiB; "
        f"engine setup {setup_s:.1f} s (graphs: {'off' if engine.runner.decode_graphs is None else 'on'})"
    )
    print(
        "| batch | engine tok/s | step ms | transformers tok/s | engine / transformers | GB/s | of peak "
        "| greedy agreement (32) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        frac = f"{r['bandwidth_fraction']:.0%}" if r["bandwidth_fraction"] else "n/a"
        print(
            f"| {r['batch']} | {r['engine_tok_s']:.1f} | {r['step_ms']:.2f} | {r['hf_tok_s']:.1f} | "
            f"{r['engine_tok_s'] / r['hf_tok_s']:.2f}x | {r['achieved_gbs']:.0f} | {frac} | "
            f"{r['greedy_agreement_first32']:.0%} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": name,
                "model": args.model or f"random {args.shape}",
                "peak_gbs": peak,
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
