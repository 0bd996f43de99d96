"""Caching on versus off, token for token: the same requests through two engines that differ only in
``enable_prefix_caching``, and the first token where their outputs part, with the blocks involved.

With greedy sampling the two runs must agree exactly (prefix caching only skips recomputing KV that is
already there); a difference means cached KV is not what recomputing it gives: a write into a shared
block, a poisoned hash, a wrong slot mapping.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import SamplingParams


@dataclass(frozen=True, slots=True)
class Divergence:
    request_index: int  # in the order the requests ran
    request_id: str
    token_index: int  # the first output token that differs
    with_caching: tuple[int, ...]
    without_caching: tuple[int, ...]
    num_cached_tokens: int  # prompt tokens the caching run took from the cache
    block_ids: tuple[int, ...]  # the request's blocks in the caching run when it finished

    def to_dict(self) -> dict:
        return {"request_index": self.request_index, "request_id": self.request_id,
                "token_index": self.token_index, "num_cached_tokens": self.num_cached_tokens,
                "block_ids": list(self.block_ids), "with_caching": list(self.with_caching),
                "without_caching": list(self.without_caching)}

    def __str__(self) -> str:
        return (f"request {self.request_id} (#{self.request_index}) differs at output token {self.token_index}: "
                f"{self.with_caching[self.token_index:self.token_index + 4]} with caching vs "
                f"{self.without_caching[self.token_index:self.token_index + 4]} without; "
                f"{self.num_cached_tokens} prompt tokens came from the cache, blocks {list(self.block_ids)}")


@dataclass(frozen=True, slots=True)
class Comparison:
    outputs_on: list[tuple[int, ...]]
    outputs_off: list[tuple[int, ...]]
    divergence: Divergence | None
    audit: str  # the caching engine's audit after the run ("audit clean" or its problems)

    def summary(self) -> str:
        """One line for a person: agreement, or where the outputs part and what the audit found."""
        n = len(self.outputs_on)
        if self.divergence is None:
            return f"caching on and off agree token for token on {n} requests; with caching: {self.audit}"
        return f"{self.divergence}; with caching: {self.audit}"


def _run_each(engine, prompts, params: SamplingParams):
    """Run the requests one after another (so later ones can hit earlier ones' blocks)."""
    outputs, meta, ids = [], [], []
    for p in prompts:
        rid = engine.add_request(p, params)
        ids.append(rid)
        blocks: tuple[int, ...] = ()
        final = None
        while engine.has_unfinished():
            out = engine.step()
            blocks = tuple(engine.kv.get_block_ids(rid)) or blocks
            final = next((o for o in out.outputs if o.request_id == rid and o.finished), final)
        outputs.append(tuple(final.outputs[0].token_ids) if final else ())
        meta.append((final.num_cached_tokens if final else 0, blocks))
    return outputs, meta, ids


def compare_caching(make_engine: Callable[[bool], object], prompts: list, max_tokens: int = 16) -> Comparison:
    """``make_engine(enable_prefix_caching)`` builds each engine (share the weights between them)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    on, off = make_engine(True), make_engine(False)
    out_on, meta, ids = _run_each(on, prompts, params)
    out_off, _, _ = _run_each(off, prompts, params)
    audit = str(on.audit())
    for i, (a, b) in enumerate(zip(out_on, out_off)):
        if a != b:
            t = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return Comparison(out_on, out_off, Divergence(i, ids[i], t, a, b, meta[i][0], meta[i][1]), audit)
    return Comparison(out_on, out_off, None, audit)
