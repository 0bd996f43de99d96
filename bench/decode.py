"""Decode throughput: the engine against transformers' generate, same weights, same run.

    python bench/decode.py [--max-tokens 64] [--batches 1 16]

Prints a table and writes bench/results/decode.json. The engine and transformers alternate for
--rounds rounds in one process and the medians are reported (the machines are shared and noisy:
a single pair of runs swung the batch-16 ratio between 0.9x and 1.3x); absolute numbers depend
on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner.models.loader import embedded_source, load_hf_model

PROMPTS = [
    "Explain what a page table is.",
    "Write a haiku about caches.",
    "What is the capital of France?",
    "Describe copy-on-write in one paragraph.",
    "List three uses of a hash map.",
    "Why is the sky blue?",
    "Summarise the plot of Hamlet.",
    "What does a scheduler do?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3, help="alternating engine / transformers runs (medians)")
    args = ap.parse_args()
    torch.manual_seed(0)
    src = embedded_source()
    model, tok = load_hf_model(src, "auto", torch.device("cpu"))
    model.generation_config.eos_token_id = None  # both sides generate exactly max_tokens
    model.generation_config.pad_token_id = tok.eos_token_id
    tok.padding_side = "left"
    llm = LLM.from_engine(LLMEngine.from_hf_model(model, tok, name=src.name, num_gpu_blocks=1024))
    rows = []
    for b in args.batches:
        chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(b)]
        texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(texts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm up
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        eng, hf = [], []
        for _ in range(args.rounds):  # alternate, so both sides see the same machine load
            t = time.perf_counter()
            outs = llm.generate(texts, params)
            eng.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
            t = time.perf_counter()
            with torch.inference_mode():
                gen = model.generate(**enc, max_new_tokens=args.max_tokens, do_sample=False)
            hf.append((gen.shape[1] - enc["input_ids"].shape[1]) * b / (time.perf_counter() - t))
        ratios = sorted(e / h for e, h in zip(eng, hf))
        rows.append(
            {
                "batch": b,
                "engine_tok_s": statistics.median(eng),
                "hf_tok_s": statistics.median(hf),
                "ratio": statistics.median(ratios),
                "ratio_min": ratios[0],
                "ratio_max": ratios[-1],
            }
        )
    print("| batch | engine tok/s | transformers generate tok/s | engine / transformers (median, range) |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['engine_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['ratio']:.2f}x "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |"
        )
    out = Path(__file__).parent / "results" / "decode.json"
    out.write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
                "torch": torch.__version__,
                "max_tokens": args.max_tokens,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
