"""Which vLLM releases the probe knows, and the internals it reads in each.

Read from the released wheels' files (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``,
``kv_cache_manager.py``, ``kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``,
``sched/scheduler.py``, ``config/scheduler.py``; ``scripts/vllm_surface.py`` extracts them):
- 0.20: ``KVCacheBlock`` a slotted dataclass with ``ref_cnt`` and ``_block_hash`` (set through a property);
  the free queue has no ``prepend_n`` (every free joins the tail); no ``deferred_frees``.
- 0.32 and 0.33: the same two slots (set through ``set_block_hash``/``reset_hash``); ``prepend_n`` (an
  unhashed block is freed to the head, LIFO); ``Scheduler.deferred_frees``, blocks out of a table but not yet
  back in the pool.
In all three: ``SchedulerConfig.get_scheduler_cls``, ``Scheduler.schedule``/``update_from_output``/
``finish_requests``/``add_request``, ``scheduler.kv_cache_manager.block_pool`` with ``blocks``,
``free_block_queue``, ``null_block``, ``cached_block_hash_to_block`` (a ``BlockHashToBlockMap``: ``insert``, ``pop``,
``_cache``), ``cache_full_blocks``, ``reset_prefix_cache``, and
``kv_cache_manager.coordinator.single_type_managers[i].req_to_blocks`` (a defaultdict: only ``.get``).
"""
from __future__ import annotations

KNOWN_RELEASES = ("0.20", "0.32", "0.33")

# what the probe reads or wraps, by object; checked on the live objects before anything is patched
REQUIRED = {
    "scheduler": ("schedule", "update_from_output", "finish_requests", "add_request", "kv_cache_manager",
                  "running", "requests"),
    "kv_cache_manager": ("block_pool", "coordinator", "allocate_slots", "free", "get_computed_blocks"),
    "block_pool": ("blocks", "free_block_queue", "null_block", "cached_block_hash_to_block", "cache_full_blocks",
                   "get_new_blocks", "touch", "free_blocks"),
    "free_block_queue": ("popleft", "popleft_n", "remove", "append", "append_n", "num_free_blocks",
                         "fake_free_list_head"),
    "block": ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block", "is_null"),
    "request": ("request_id", "status", "num_prompt_tokens", "num_tokens", "all_token_ids", "num_computed_tokens",
                "block_hashes", "arrival_time"),
}


def release_of(version: str) -> str | None:
    """``"0.32.0"`` -> ``"0.32"`` if the probe knows that release, else None (dev builds included:
    ``0.32.1.dev3+g...`` is 0.32)."""
    parts = version.split(".")
    if len(parts) < 2:
        return None
    major_minor = f"{parts[0]}.{''.join(ch for ch in parts[1] if ch.isdigit())}"
    return major_minor if major_minor in KNOWN_RELEASES else None


def missing(scheduler) -> list[str]:
    """What the probe needs and this scheduler does not have ("block_pool.touch", ...): empty when it fits."""
    out = []
    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    objects = {"scheduler": scheduler, "kv_cache_manager": manager, "block_pool": pool,
               "free_block_queue": getattr(pool, "free_block_queue", None)}
    for what, names in REQUIRED.items():
        if what in ("block", "request"):
            continue
        obj = objects[what]
        out += [f"{what}.{n}" for n in names if obj is None or not hasattr(obj, n)]
    if pool is not None and getattr(pool, "blocks", None):
        cls = type(pool.blocks[0])
        for slot in ("ref_cnt", "_block_hash"):
            if type(cls.__dict__.get(slot)).__name__ not in ("member_descriptor", "property"):
                out.append(f"KVCacheBlock.{slot} (a slot)")
        out += [f"KVCacheBlock.{n}" for n in REQUIRED["block"] if not hasattr(pool.blocks[0], n)]
    hash_map = getattr(pool, "cached_block_hash_to_block", None)
    out += [f"cached_block_hash_to_block.{n}" for n in ("_cache", "insert", "pop") if not hasattr(hash_map, n)]
    coordinator = getattr(manager, "coordinator", None)
    managers = getattr(coordinator, "single_type_managers", None)
    if not managers or not hasattr(managers[0], "req_to_blocks"):
        out.append("coordinator.single_type_managers[0].req_to_blocks")
    return out
