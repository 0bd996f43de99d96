"""One engine's offline ``LLM.generate`` for the peer benchmark, in a process of its own, on command.

    python bench/peer_offline.py --engine kvscope --model FOLDER --block-size 32
    VLLM_PYTHON bench/peer_offline.py --engine vllm --model FOLDER --block-size 32

Reads the prompts (token ids, one JSON list of lists) from the first line of stdin and loads the model, then
answers ``PEER ready``; each further line ``run`` generates every prompt at once (greedy, ``ignore_eos``,
``--max-tokens`` each) and answers ``PEER`` and a JSON object: the seconds ``generate`` took, the tokens it
produced and their ids (the engines' logs may share stdout: the parent reads only ``PEER`` lines). A line
``quit`` (or the end of stdin) ends it. Only the named engine is imported: run under vLLM's own Python,
nothing of kvscope is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def kvscope_generate(model: str, block_size: int, dtype: str):
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, block_size=block_size)
    tok = llm.get_tokenizer()

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    return generate, tok


def vllm_generate(model: str, block_size: int, dtype: str):
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, dtype=dtype, block_size=block_size, max_model_len=2048, disable_log_stats=True)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("kvscope", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    prompts = json.loads(sys.stdin.readline())
    make = kvscope_generate if args.engine == "kvscope" else vllm_generate
    generate, _tok = make(args.model, args.block_size, args.dtype)
    generate(prompts[:2], 4)  # warm-up: first-call costs are not the engine's speed
    print("PEER ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        outs = generate(prompts, args.max_tokens)
        seconds = time.perf_counter() - t0
        print("PEER", json.dumps({"seconds": seconds, "tokens": sum(map(len, outs)), "token_ids": outs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
