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
``kv_cache_manager.coordinator.single_type_managers[i].req_to_blocks`` (a defaultdict: only ``.get``), every group's
(a hybrid model has several; ``groups.py`` names each by its manager's class).
Read when there (``OPTIONAL``, and by ``getattr``): 0.32's ``KVCacheManager.get_computed_blocks_for_connector``
(the lookup of a request scheduled with a connector), the hybrid coordinator's
``find_longest_cache_hit_per_group`` (each group's own hit: which group missed), ``BlockPool.hash_block_size``,
``Scheduler.connector`` (whose scheduler-side methods the recorder wraps: a connector's pins).
"""

from __future__ import annotations

KNOWN_RELEASES = ("0.20", "0.32", "0.33")

# what the probe reads or wraps, by vLLM's class name: checked on the live objects before anything is patched,
# and against each known release's files (tests/probe/test_compat.py)
REQUIRED = {
    "Scheduler": (
        "schedule",
        "update_from_output",
        "finish_requests",
        "add_request",
        "kv_cache_manager",
        "running",
        "requests",
    ),
    "KVCacheManager": ("block_pool", "coordinator", "allocate_slots", "free", "get_computed_blocks"),
    "BlockPool": (
        "blocks",
        "free_block_queue",
        "null_block",
        "cached_block_hash_to_block",
        "cache_full_blocks",
        "get_new_blocks",
        "touch",
        "free_blocks",
        "reset_prefix_cache",
    ),
    "BlockHashToBlockMap": ("_cache", "insert", "pop"),
    "FreeKVCacheBlockQueue": (
        "popleft",
        "popleft_n",
        "remove",
        "append",
        "append_n",
        "num_free_blocks",
        "fake_free_list_head",
    ),
    "KVCacheCoordinator": ("single_type_managers", "block_pool"),
    "SingleTypeKVCacheManager": ("req_to_blocks",),
    "KVCacheBlock": ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block", "is_null"),
    "Request": (
        "request_id",
        "status",
        "num_prompt_tokens",
        "num_tokens",
        "all_token_ids",
        "_all_token_ids",
        "num_computed_tokens",
        "block_hashes",
        "arrival_time",
        "is_finished",
    ),
    "SchedulerConfig": ("get_scheduler_cls",),
}
SLOTS = ("ref_cnt", "_block_hash")  # KVCacheBlock's slots the recorder puts its descriptors over
OPTIONAL = {  # read when there
    "FreeKVCacheBlockQueue": ("prepend_n",),
    "Scheduler": ("deferred_frees",),
    "KVCacheManager": ("get_computed_blocks_for_connector",),
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
    """What the probe needs and this scheduler does not have ("BlockPool.touch", ...): empty when it fits."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    coordinator = getattr(manager, "coordinator", None)
    managers = getattr(coordinator, "single_type_managers", None) or (None,)
    blocks = getattr(pool, "blocks", None) or (None,)
    objects = {
        "Scheduler": scheduler,
        "KVCacheManager": manager,
        "BlockPool": pool,
        "BlockHashToBlockMap": getattr(pool, "cached_block_hash_to_block", None),
        "FreeKVCacheBlockQueue": getattr(pool, "free_block_queue", None),
        "KVCacheCoordinator": coordinator,
        "SingleTypeKVCacheManager": managers[0],
        "KVCacheBlock": blocks[0],
    }
    out = [f"{what}.{n}" for what, obj in objects.items() for n in REQUIRED[what] if obj is None or not hasattr(obj, n)]
    if blocks[0] is not None:
        cls = type(blocks[0])
        out += [
            f"KVCacheBlock.{n} (a slot)"
            for n in SLOTS
            if type(cls.__dict__.get(n)).__name__ not in ("member_descriptor", "property")
        ]
    return out
