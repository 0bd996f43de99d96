"""Command line: every engine setting, plus the app's modes (window, headless, screenshot)."""
from __future__ import annotations

import argparse

from engine import EngineConfig

from .kv_events_cli import add_kv_events_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvscope",
        description="Inspect a paged KV cache live: a real Llama-family model runs on a worker thread while the "
                    "window draws the physical block pool, block tables, ref counts, the prefix cache and "
                    "preemptions step by step. With no --model it runs the embedded SmolLM2-135M-Instruct.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="a short name (llama-2-7b, tinyllama, ...), a hub id, a local folder or a .gguf file; "
                        "default: the embedded SmolLM2-135M-Instruct")
    m.add_argument("--device", default="auto", help="cpu, cuda, cuda:N; auto picks cuda when available")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and activations; auto keeps the checkpoint's dtype")
    k = p.add_argument_group("KV cache")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    k.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="number of physical blocks in the pool (overrides every sizing rule)")
    k.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="size the pool by bytes (block bytes = 2 x layers x kv_heads x head_dim x dtype x block)")
    k.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA: fraction of the GPU's memory for weights + activations + the KV pool")
    k.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8", "int4"],
                   help="store KV quantized: fp8 (e4m3, a scale per head), int8 (a scale per token and head), "
                        "int4 (int4 V with int8 K); about 2x the blocks of a 16-bit cache in the same memory")
    k.add_argument("--max-model-len", type=int, default=None,
                   help="cap the context length (default: the model's); a smaller cap fits a smaller KV pool")
    k.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    m.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="paged attention: triton kernels (the default on CUDA) or the PyTorch reference")
    m.add_argument("--enforce-eager", action="store_true", help="on CUDA: do not capture CUDA graphs for decode")
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step (long prompts are prefilled in chunks)")
    s.add_argument("--seed", type=int, default=0, help="seed of the default sampling generator")
    a = p.add_argument_group("app")
    a.add_argument("--headless", action="store_true", help="no window: run and print a summary")
    a.add_argument("--json", action="store_true", help="with --headless: print the summary as JSON")
    a.add_argument("--steps", type=int, default=None, help="steps to run (headless, screenshot); default: until done")
    a.add_argument("--inject", action="append", default=[], metavar="TEXT",
                   help="inject a request with this prompt at start (repeatable)")
    a.add_argument("--max-tokens", type=int, default=48, help="max tokens of --inject requests")
    a.add_argument("--scenario", default=None, metavar="NAME_OR_FILE",
                   help="run a scenario from resources/scenarios (its settings override the engine options)")
    a.add_argument("--trace", default=None, metavar="FILE", help="record the run as a JSON-lines trace")
    a.add_argument("--replay", default=None, metavar="FILE",
                   help="play a recorded trace back (no model, no GPU)")
    a.add_argument("--audit", action="store_true", help="audit ref counts after every step")
    a.add_argument("--fault", default=None, choices=["abort-leak", "cow-leak", "double-free"],
                   help="switch on a deliberate bug, to practise finding leaks")
    a.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="what preemption does with a request's KV")
    a.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU pool for swap preemption")
    a.add_argument("--screenshot", metavar="FILE", default=None,
                   help="build the window offscreen, run --steps steps, save a PNG of the window, exit")
    add_kv_events_args(p)
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    cfg = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed, fault=args.fault, preemption_mode=args.preemption_mode, swap_space=args.swap_space,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype)
    cfg.validate()
    return cfg
