"""vLLM's KV cache groups, as the probe describes them: one ``KVGroup`` a single-type manager.

A hybrid model (sliding-window and full-attention layers, Mamba or gated-delta-net layers beside attention)
has several KV cache groups in one ``BlockPool``: ``kv_cache_manager.coordinator.single_type_managers[g]``
manages group ``g``'s tables (``req_to_blocks``) by its own rules. A full-attention group holds a block for
every ``block_size`` tokens until the request ends; a sliding-window (or chunked-local) group puts vLLM's null
block in place of the blocks that left its window; a Mamba group holds state blocks (with prefix caching on,
"align" mode: a state at a block boundary, earlier ones retired to the null block).
"""

from __future__ import annotations

from .wire import KVGroup

# vLLM's manager classes by the kind the probe calls them (a subclass not named here is its class name)
KINDS = {
    "FullAttentionManager": "full",
    "SlidingWindowManager": "sliding_window",
    "ChunkedLocalAttentionManager": "chunked_local",
    "MambaManager": "mamba",
}
# kinds whose tables only grow until the request ends: no entry is ever replaced by the null block
GROWING = frozenset({"full"})


def kind_of(manager) -> str:
    name = type(manager).__name__
    return KINDS.get(name, name)


def describe(scheduler) -> list[KVGroup]:
    """Every KV cache group of this scheduler, by its id."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    specs = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None) or [None] * len(managers)
    out = []
    for m, g in zip(managers, specs):
        spec = getattr(m, "kv_cache_spec", None)
        window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None) or 0
        out.append(
            KVGroup(
                kind=kind_of(m),
                block_size=int(getattr(m, "block_size", 0) or 0),
                window=int(window),
                layers=len(getattr(g, "layer_names", ()) or ()),
                manager=type(m).__name__,
                mode=str(getattr(spec, "mamba_cache_mode", "") or ""),
            )
        )
    return out
