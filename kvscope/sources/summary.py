"""``Summary``: what a run did, the same from a live run and from its trace (``--headless``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.inspect.cache_miss import CacheMissExplainer

from .base import StepRecord


@dataclass
class Summary:
    requests: dict[str, dict] = field(default_factory=dict)
    peak_usage: float = 0.0
    peak_blocks_used: int = 0
    last: StepRecord | None = None
    decode: Callable[[list[int]], str | None] | None = None  # for the text in the miss explanations
    misses: CacheMissExplainer | None = None

    def add(self, rec: StepRecord) -> None:
        self.last = rec
        if self.misses is None:
            self.misses = CacheMissExplainer(rec.snapshot.block_size, self.decode)
        self.misses.feed(rec.step, rec.events,  # the prompts are sliced only in a step that admits
                         lambda: {r.request_id: r.token_ids[:r.num_prompt_tokens] for r in rec.snapshot.requests})
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
            "block_size": snap.block_size, "requests": [self._with_miss(r) for r in self.requests.values()],
            "kv_cache_usage_perc": c["kv_cache_usage_perc"], "kv_cache_usage_perc_peak": self.peak_usage,
            "blocks_used_peak": self.peak_blocks_used,
            "prefix_cache_queries": c["prefix_cache_queries"], "prefix_cache_hits": c["prefix_cache_hits"],
            "num_preemptions": c["num_preemptions"], "cow_copies": c["cow_copies"], "evictions": c["evictions"],
            "swap_outs": c["swap_outs"], "swap_ins": c["swap_ins"], "leaked_blocks": len(self.last.leaked),
            "generation_tokens": c["generation_tokens"],
            "audit_problems": [str(p) for p in self.last.audit.problems] if self.last.audit else [],
        }

    def _with_miss(self, r: dict) -> dict:
        """The request's first prefix-cache miss and its reason (None: not admitted yet, or nothing missed)."""
        miss = self.misses.misses.get(r["request_id"]) if self.misses else None
        return {**r, "prefix_cache_miss": miss.to_dict() if miss else None}
