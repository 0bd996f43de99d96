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
    {"op": "connector", "delay_free": true, "load": {"r0": 32}, "pin": [3], "unpin": true, "second_pool": true}
                                                                         script the scripted connector
    {"op": "kv_output", "finished_sending": ["r0"], "finished_recving": [], "failed_recving": []}
                                                                         what the next update's connector output says
    {"op": "quit"}
Options: ``--groups sliding:64,full`` (KV cache groups: full, sliding:WINDOW, mamba; vLLM's hybrid coordinator for
more than one), ``--async`` (vLLM's AsyncScheduler, stepped as its engine core steps it: the next batch is scheduled
before the last one's output is applied), ``--connector`` (tests/probe_vllm/scripted_connector.py).
Used by the probe's tests (tests/kvscope/sources/test_probe_*.py) and its benchmark (bench/probe_cost.py). The tests
fork it from a process that has imported vLLM already (``zygote.py``): ``main()`` runs the same either way.
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


def group_specs(groups: str, block_size: int) -> list:
    """``full``, ``sliding:WINDOW``, ``mamba`` (align mode, a full-attention page's size), comma separated: vLLM's
    KVCacheGroupSpecs, one layer each."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
    out = []
    for i, g in enumerate(groups.split(",")):
        kind, _, arg = g.partition(":")
        if kind == "full":
            spec = full
        elif kind == "sliding":
            spec = SlidingWindowSpec(
                block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=int(arg)
            )
        elif kind == "mamba":
            spec = MambaSpec(
                block_size=block_size,
                shapes=((1, 64),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                page_size_padded=full.page_size_bytes,
            )
        else:
            raise SystemExit(f"unknown group kind {kind!r}")
        out.append(KVCacheGroupSpec([f"layer{i}"], spec))
    return out


def make_scheduler(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    enable_caching: bool = True,
    dp_rank: int = 0,
    groups: str = "full",
    async_scheduling: bool = False,
    connector: bool = False,
):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(model=model_folder(), dtype="float32", max_model_len=4096, seed=0)
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=enable_caching)
    if "mamba" in groups:
        cc.mamba_cache_mode = "align"
    cc.num_gpu_blocks = num_blocks
    kv_transfer = None
    if connector:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        kv_transfer = KVTransferConfig(
            kv_connector="ScriptedConnector", kv_role="kv_both", kv_connector_module_path="scripted_connector"
        )
    cfg = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kv_transfer)
    # a data-parallel rank of a dense model, as vLLM's engine core sets it (its data_parallel_size stays 1)
    cfg.parallel_config.data_parallel_index = dp_rank
    # here, not in SchedulerConfig: VllmConfig turns it off for the CPU platform (a server here cannot run it),
    # while vLLM's AsyncScheduler itself runs anywhere
    sc.async_scheduling = async_scheduling
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=group_specs(groups, block_size))
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


KV_OUTPUT: dict[str, set[str]] = {}  # what the next update's connector output reports (the kv_output op)


def _scheduled(s):
    """One schedule, with which of its requests sample a token (a prefill chunk that does not reach the
    prompt's end samples nothing: read now, before a later schedule changes the request)."""
    out = s.schedule()
    samples = {}
    for rid in out.num_scheduled_tokens:
        r = s.requests.get(rid)
        samples[rid] = r is not None and not getattr(r, "is_prefill_chunk", False)
    return out, samples


def _update(s, out, samples, token: int) -> None:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = [[token] if samples.get(rid) else [] for rid in ids]
    kv = None
    if KV_OUTPUT:
        kv = KVConnectorOutput(
            finished_sending=KV_OUTPUT.pop("finished_sending", set()) or None,
            finished_recving=KV_OUTPUT.pop("finished_recving", set()) or None,
            failed_recving=KV_OUTPUT.pop("failed_recving", set()),
        )
        KV_OUTPUT.clear()
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv,
    )
    s.update_from_output(out, mro)


_in_flight: list = []  # the async engine core's batch queue: a batch scheduled, its output not applied yet


def step(s, token: int = 7) -> bool:
    """One engine-core step, every scheduled request sampling ``token`` when its prefill is done: a schedule and
    its update; with an AsyncScheduler, as vLLM's engine core steps it, the next schedule before the update of the
    batch before (which runs on the device meanwhile)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    if not s.has_requests() and not _in_flight and not KV_OUTPUT:
        return False
    if isinstance(s, AsyncScheduler):  # two batches in flight at most (vLLM's max_concurrent_batches)
        scheduled = s.has_requests() and len(_in_flight) < 2
        if scheduled:
            _in_flight.append(_scheduled(s))
        if _in_flight and (len(_in_flight) == 2 or not scheduled):
            out, samples = _in_flight.pop(0)
            _update(s, out, samples, token)
        return True
    out, samples = _scheduled(s)
    _update(s, out, samples, token)
    return True


def dump(s) -> dict:
    """The pool as vLLM holds it, read directly: what the probe's subscriber must agree with."""
    pool = s.kv_cache_manager.block_pool
    free, node = [], pool.free_block_queue.fake_free_list_head.next_free_block
    while node is not None and node.block_id >= 0:
        free.append(node.block_id)
        node = node.next_free_block
    groups = [
        {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
        for m in s.kv_cache_manager.coordinator.single_type_managers
    ]
    connector = getattr(s, "connector", None)
    return {
        "tables": groups[0],
        "group_tables": groups,
        "deferred": [[b.block_id for b in blocks] for _fence, blocks in getattr(s, "deferred_frees", ())],
        "pinned": sorted(b.block_id for b in getattr(connector, "pinned", ())),
        "requests": {rid: r.status.name for rid, r in s.requests.items()},
        "tokens": {rid: list(r.all_token_ids) for rid, r in s.requests.items()},
        "computed": {rid: r.num_computed_tokens for rid, r in s.requests.items()},
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "hashes": {
            str(b.block_id): int.from_bytes(b.block_hash[-12:-4], "big")
            for b in pool.blocks
            if b.block_hash is not None
        },
        "free_queue": free,
        "step": getattr(getattr(s, "_kvscope_probe", None), "step", None),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--pretend-version", default=None, help="vLLM's version as the probe reads it")
    ap.add_argument("--dp-rank", type=int, default=0, help="the data-parallel rank this scheduler is")
    ap.add_argument("--groups", default="full", help="KV cache groups: full, sliding:WINDOW, mamba (comma separated)")
    ap.add_argument("--async", dest="async_scheduling", action="store_true", help="vLLM's AsyncScheduler")
    ap.add_argument("--connector", action="store_true", help="the scripted KV connector")
    args = ap.parse_args()
    import logging

    # vLLM's log, as a server has it (the probe's lines go to vLLM's logger, which nothing here sets up)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.pretend_version:
        import vllm

        vllm.__version__ = args.pretend_version
    from kvscope_vllm_probe.plugin import register

    register()  # as vLLM's plugin loader would (inert without KVSCOPE_PROBE_ENDPOINT)
    s = make_scheduler(
        args.num_blocks,
        args.block_size,
        args.max_num_seqs,
        dp_rank=args.dp_rank,
        groups=args.groups,
        async_scheduling=args.async_scheduling,
        connector=args.connector,
    )
    probed = getattr(s, "_kvscope_probe", None) is not None
    bases = [c.__name__ for c in type(s).__mro__]
    print(json.dumps({"ready": True, "probed": probed, "scheduler": type(s).__name__, "bases": bases}), flush=True)
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
        elif op == "connector":
            c = s.connector
            with p_lock(s, lock):
                c.delay_free = cmd.get("delay_free", c.delay_free)
                c.load.update(cmd.get("load", {}))
                c.pin += cmd.get("pin", [])
                c.unpin = cmd.get("unpin", c.unpin)
                if cmd.get("second_pool") and c.second_pool is None:
                    c.make_second_pool()
            ans = {"ok": True}
        elif op == "kv_output":
            with p_lock(s, lock):
                for key in ("finished_sending", "finished_recving", "failed_recving"):
                    KV_OUTPUT.setdefault(key, set()).update(cmd.get(key, ()))
            ans = {"ok": True}
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


def p_lock(s, lock):
    """The probe's lock when probed (its I/O thread reads the pool under it), else the harness's."""
    p = getattr(s, "_kvscope_probe", None)
    return p.lock if p is not None else lock


if __name__ == "__main__":
    main()
