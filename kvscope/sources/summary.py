"""``Summary``: what a run did, the same from a live run and from its trace (``--headless``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .base import StepRecord


@dataclass
class Summary:
    requests: dict[str, dict] = field(default_factory=dict)
    peak_usage: float = 0.0
    peak_blocks_used: int = 0
    last: StepRecord | None = None

    def add(self, rec: StepRecord) -> None:
        self.last = rec
        c = rec.snapshot.counters
        self.peak_usage = max(self.peak_usage, float(c["kv_cache_usage_perc"]))
        self.peak_blocks_used = max(self.peak_blocks_used, int(c["num_blocks"] - c["num_free_blocks"]))
        for r in rec.snapshot.requests:
            self.requests[r.request_id] = {
                "request_id": r.request_id, "status": r.status.lower(), "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens, "cached_tokens": r.num_cached_tokens, "text": r.text}

    def as_dict(self) -> dict:
        snap = self.last.snapshot
        c = snap.counters
        return {
            "model": snap.model_name, "steps": snap.step, "num_blocks": snap.num_blocks,
            "block_size": snap.block_size, "requests": list(self.requests.values()),
            "kv_cache_usage_perc": c["kv_cache_usage_perc"], "kv_cache_usage_perc_peak": self.peak_usage,
            "blocks_used_peak": self.peak_blocks_used,
            "prefix_cache_queries": c["prefix_cache_queries"], "prefix_cache_hits": c["prefix_cache_hits"],
            "num_preemptions": c["num_preemptions"], "cow_copies": c["cow_copies"], "evictions": c["evictions"],
            "swap_outs": c["swap_outs"], "swap_ins": c["swap_ins"], "leaked_blocks": len(self.last.leaked),
            "generation_tokens": c["generation_tokens"],
        }
