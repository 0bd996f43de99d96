"""Caching on versus off, token for token: the same requests through two engines that differ only in
``enable_prefix_caching``, and the first token where their outputs part, with the blocks involved.

With greedy sampling the two runs must agree exactly (prefix caching only skips recomputing KV that is
already there); a difference means cached KV is not what recomputing it gives: a write into a shared
block, a poisoned hash, a wrong slot mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import SamplingParams


@dataclass(frozen=True, slots=True)
class Divergence:
    request_index: int  # in the order the requests ran
    request_id: str
    token_index: int  # the first output token that differs
    with_caching: tuple[int, ...]
    without_caching: tuple[int, ...]
    num_cached_tokens: int  # prompt tokens the caching run took from the cache
    # The request's blocks in the comparison's own caching engine when it finished: that engine is built
    # for the comparison, so these ids are not the blocks of the engine the window or a run shows.
    block_ids: tuple[int, ...]
    with_text: str = ""  # the outputs from the first differing token on, as text (empty without a tokenizer)
    without_text: str = ""

    def to_dict(self) -> dict:
        return {
            "request_index": self.request_index,
            "request_id": self.request_id,
            "token_index": self.token_index,
            "num_cached_tokens": self.num_cached_tokens,
            "block_ids": list(self.block_ids),
            "with_caching": list(self.with_caching),
            "without_caching": list(self.without_caching),
            "with_caching_text": self.with_text,
            "without_caching_text": self.without_text,
        }

    def __str__(self) -> str:
        t = self.token_index
        if self.with_text or self.without_text:
            said = f"{self.with_text!r} with caching vs {self.without_text!r} without"
        else:
            said = (
                f"tokens {list(self.with_caching[t : t + 4])} with caching vs "
                f"{list(self.without_caching[t : t + 4])} without"
            )
        return (
            f"request #{self.request_index} differs from output token {t} on: {said}; "
            f"{self.num_cached_tokens} of its prompt tokens came from the cache "
            f"(blocks {list(self.block_ids)} of the comparison's own caching engine)"
        )


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


def compare_caching(
    make_engine: Callable[[bool], Any],  # an LLMEngine (the engine's top level, above this module)
    prompts: list,
    max_tokens: int = 16,
    decode: Callable[[list[int]], str] | None = None,
) -> Comparison:
    """``make_engine(enable_prefix_caching)`` builds each engine (share the weights between them);
    ``decode`` (a tokenizer's) turns the parting outputs into text for a person."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    on, off = make_engine(True), make_engine(False)
    out_on, meta, ids = _run_each(on, prompts, params)
    out_off, _, _ = _run_each(off, prompts, params)
    audit = str(on.audit())
    for i, (a, b) in enumerate(zip(out_on, out_off)):
        if a != b:
            t = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            texts = (_text(decode, a[t : t + 8]), _text(decode, b[t : t + 8])) if decode else ("", "")
            return Comparison(out_on, out_off, Divergence(i, ids[i], t, a, b, meta[i][0], meta[i][1], *texts), audit)
    return Comparison(out_on, out_off, None, audit)


def _text(decode: Callable[[list[int]], str], tokens: tuple[int, ...]) -> str:
    """A few tokens as text; a tokenizer that cannot say them leaves the ids to speak."""
    try:
        return decode(list(tokens))
    except Exception:  # noqa: BLE001 - a token id beyond the tokenizer: the ids are in the line anyway
        return ""
