"""Decode throughput: the engine against transformers' generate, same weights, same run.

    python bench/decode.py [--max-tokens 64] [--batches 1 16]

Prints a table and writes bench/results/decode.json. Ratios are measured side by side in one
process (the machines are shared and noisy); absolute numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.models.loader import embedded_source, load_hf_model

PROMPTS = ["Explain what a page table is.", "Write a haiku about caches.", "What is the capital of France?",
           "Describe copy-on-write in one paragraph.", "List three uses of a hash map.", "Why is the sky blue?",
           "Summarise the plot of Hamlet.", "What does a scheduler do?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
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
        t = time.perf_counter()
        outs = llm.generate(texts, params)
        eng_s = time.perf_counter() - t
        n_eng = sum(len(o.outputs[0].token_ids) for o in outs)
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        t = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=args.max_tokens, do_sample=False)
        hf_s = time.perf_counter() - t
        n_hf = (gen.shape[1] - enc["input_ids"].shape[1]) * b
        rows.append({"batch": b, "engine_tok_s": n_eng / eng_s, "hf_tok_s": n_hf / hf_s,
                     "ratio": (n_eng / eng_s) / (n_hf / hf_s)})
    print("| batch | engine tok/s | transformers generate tok/s | engine / transformers |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['engine_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['ratio']:.2f}x |")
    out = Path(__file__).parent / "results" / "decode.json"
    out.write_text(json.dumps({"machine": f"{platform.machine()} {torch.get_num_threads()} threads",
                               "torch": torch.__version__, "max_tokens": args.max_tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
