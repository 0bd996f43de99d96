"""vLLM's real scheduler, block pool and KV cache manager, stepped with made-up model outputs (no model, no
server): runs in a Python that has vLLM and the probe installed (``scripts/setup_vllm.sh``'s ``.venv-vllm``).

The probe is started exactly as in a server: ``kvscope_vllm_probe.plugin.register()`` patches
``SchedulerConfig.get_scheduler_cls``, and the scheduler is built from the class it returns. Commands on stdin
(one JSON object a line) drive it, and its answers go to stdout, one JSON object a line:
    {"op": "add", "id": "r0", "prompt": [1, 2, ...], "max_tokens": 8}   add a request
    {"op": "step", "n": 1}                                              schedule and update n times (if work)
    {"op": "run"}                                                       step until nothing is left
    {"op": "abort", "id": "r0"}                                          finish it as aborted
    {"op": "spin", "on": true, "pace": 0.02}                             step on a thread of its own whenever
                                                                         there is work (as vLLM's engine core),
                                                                         each step taking "pace" seconds
    {"op": "dump"}                                                       the pool as read straight from vLLM
    {"op": "quit"}
Used by the probe's tests (tests/kvscope/sources/test_probe_*.py) and its benchmark (bench/probe_cost.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def model_folder() -> str:
    """A model config vLLM can read without the network: kvscope's conversion of SmolLM2 (its cache), or the
    folder in ``KVSCOPE_VLLM_MODEL``."""
    folder = os.environ.get("KVSCOPE_VLLM_MODEL")
    if folder:
        return folder
    import glob

    base = os.environ.get("KVSCOPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvscope"
    )
    found = sorted(glob.glob(os.path.join(base, "gguf", "SmolLM2-135M-Instruct*", "config.json")))
    if not found:
        sys.exit("no model config: set KVSCOPE_VLLM_MODEL to a folder with a config.json")
    return os.path.dirname(found[-1])


def make_scheduler(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    enable_caching: bool = True,
    dp_rank: int = 0,
):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(model=model_folder(), dtype="float32", max_model_len=4096, seed=0)
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=enable_caching)
    cc.num_gpu_blocks = num_blocks
    cfg = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    # a data-parallel rank of a dense model, as vLLM's engine core sets it (its data_parallel_size stays 1)
    cfg.parallel_config.data_parallel_index = dp_rank
    kvc = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
            )
        ],
    )
    hash_fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    cls = sc.get_scheduler_cls()  # the probe's subclass when the plugin registered
    s = cls(
        vllm_config=cfg,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(cfg),
        log_stats=False,
        block_size=block_size,
        hash_block_size=block_size,
    )
    s._harness_hasher = get_request_block_hasher(block_size, hash_fn)
    return s


def add(s, rid: str, prompt: list[int], max_tokens: int) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(Request(rid, prompt, params, None, block_hasher=s._harness_hasher))


def step(s, token: int = 7) -> bool:
    """One schedule and update, every scheduled request sampling ``token`` when its prefill is done."""
    from vllm.v1.outputs import ModelRunnerOutput

    if not s.has_requests():
        return False
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = s.requests.get(rid)
        # a chunk that does not reach the prompt's end samples nothing
        done = r is not None and r.num_computed_tokens + 0 >= r.num_prompt_tokens
        sampled.append([token] if done else [])
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled)
    s.update_from_output(out, mro)
    return True


def dump(s) -> dict:
    """The pool as vLLM holds it, read directly: what the probe's subscriber must agree with."""
    pool = s.kv_cache_manager.block_pool
    free, node = [], pool.free_block_queue.fake_free_list_head.next_free_block
    while node is not None and node.block_id >= 0:
        free.append(node.block_id)
        node = node.next_free_block
    tables = {
        rid: [b.block_id for b in blocks]
        for rid, blocks in s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.items()
    }
    return {
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "hashes": {
            str(b.block_id): int.from_bytes(b.block_hash[-12:-4], "big")
            for b in pool.blocks
            if b.block_hash is not None
        },
        "free_queue": free,
        "tables": tables,
        "step": getattr(getattr(s, "_kvscope_probe", None), "step", None),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--pretend-version", default=None, help="vLLM's version as the probe reads it")
    ap.add_argument("--dp-rank", type=int, default=0, help="the data-parallel rank this scheduler is")
    args = ap.parse_args()
    import logging

    # vLLM's log, as a server has it (the probe's lines go to vLLM's logger, which nothing here sets up)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.pretend_version:
        import vllm

        vllm.__version__ = args.pretend_version
    from kvscope_vllm_probe.plugin import register

    register()  # as vLLM's plugin loader would (inert without KVSCOPE_PROBE_ENDPOINT)
    s = make_scheduler(args.num_blocks, args.block_size, args.max_num_seqs, dp_rank=args.dp_rank)
    probed = getattr(s, "_kvscope_probe", None) is not None
    print(json.dumps({"ready": True, "probed": probed, "scheduler": type(s).__name__}), flush=True)
    import contextlib
    import threading

    # A probed scheduler serializes its entries itself (and its pause waits outside that lock); a bare one here.
    lock = contextlib.nullcontext() if probed else threading.Lock()
    spinning = threading.Event()
    pace = [0.0]  # seconds a step's forward pass takes (a model's time, so that a subscriber sees steps go by)

    def spin() -> None:
        while spinning.is_set():
            with lock:
                worked = step(s)
            time.sleep(pace[0] if worked else 0.002)

    spinner = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "add":
            with lock:
                add(s, cmd["id"], cmd["prompt"], cmd.get("max_tokens", 8))
            ans = {"ok": True}
        elif op == "step":
            n = sum(step(s) for _ in range(cmd.get("n", 1)))
            ans = {"stepped": n}
        elif op == "run":
            n = 0
            while step(s):
                n += 1
            ans = {"stepped": n}
        elif op == "spin":
            pace[0] = cmd.get("pace", pace[0])
            if cmd.get("on", True) and spinner is None:
                spinning.set()
                spinner = threading.Thread(target=spin, daemon=True)
                spinner.start()
            elif not cmd.get("on", True) and spinner is not None:
                spinning.clear()
                spinner.join()
                spinner = None
            ans = {"ok": True}
        elif op == "busy":
            with lock:
                ans = {"requests": len(s.requests)}
        elif op == "abort":
            from vllm.v1.request import RequestStatus

            with lock:
                s.finish_requests(cmd["id"], RequestStatus.FINISHED_ABORTED)
            ans = {"ok": True}
        elif op == "dump":
            p = getattr(s, "_kvscope_probe", None)
            with p.lock if p is not None else lock:
                ans = dump(s)
        elif op == "sleep":
            time.sleep(cmd["s"])
            ans = {"ok": True}
        elif op == "quit":
            spinning.clear()
            break
        else:
            ans = {"error": f"unknown op {op}"}
        print(json.dumps(ans), flush=True)
    if hasattr(s, "shutdown"):
        s.shutdown()


if __name__ == "__main__":
    main()
