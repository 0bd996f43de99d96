"""What the window explains on demand (Qt-free): why a request missed the prefix cache, a block's life
story over the timeline's reach, and which prompts a caching comparison should replay.

The miss explainer is fed every step's events as they arrive, so each request is judged against the
cache as it was when the request was admitted (not as it is when someone asks). It keeps the explanations
of the last ``limits.miss_explanations`` requests and the last ``limits.evicted_blocks`` evicted blocks
(``kvscope.limits``); the request the window asked about last (the selected one) is never dropped. A
block's story is read from the history's events when a block is selected: it costs one pass over the
recorded events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engine.inspect.block_story import StoryLine, block_story
from engine.inspect.cache_miss import CacheMiss, CacheMissExplainer
from engine.inspect.cache_miss_groups import GroupedMissExplainer, make_miss_explainer
from engine.inspect.kv_groups import KVCacheGroup, name_of
from engine.inspect.snapshot import KVSnapshot
from engine.request_ids import BEAM_SEP, FORK_SEP, SAMPLE_SEP
from kvscope.history import RunHistory
from kvscope.limits import LIMITS, WindowLimits, misses_text

GROUP_LINES = ("allocated", "hit", "stored")  # a hybrid model's story names the group on these lines
ENGINE_MADE = (SAMPLE_SEP, FORK_SEP, BEAM_SEP)  # samples, forks, beams: they replay with their parent
MADE_AS = {SAMPLE_SEP: "a parallel sample", FORK_SEP: "a fork", BEAM_SEP: "a beam"}


# the window's request panel and --headless say it alike: no lookup, so no miss to explain
CACHING_OFF = "prefix cache: off in this engine (--no-prefix-caching, or the contiguous layout)"


class Diagnosis:
    def __init__(
        self,
        decode: Callable[[list[int]], str | None] | None = None,
        prefix_caching: bool = True,
        limits: WindowLimits = LIMITS,
        kv_groups: tuple[KVCacheGroup, ...] = (),
    ) -> None:
        """``kv_groups``: a hybrid model's KV cache groups (a probed vLLM's), whose misses are told by group."""
        self.decode = decode
        self.prefix_caching = prefix_caching
        self.limits = limits
        self.kv_groups = tuple(kv_groups)
        self.misses: CacheMissExplainer | GroupedMissExplainer | None = None

    def feed(self, step: int, events, snap: KVSnapshot) -> None:
        if self.misses is None:
            self.misses = make_miss_explainer(
                snap.block_size,
                self.decode,
                self.limits.miss_explanations,
                self.limits.evicted_blocks,
                groups=self.kv_groups,
            )
        self.misses.feed_snapshot(step, events, snap)

    def miss_text(self, snap: KVSnapshot | None, request_id: str) -> str:
        """The selected request's prefix-cache story in one or two lines. The request asked about is the one
        whose explanation the bound never drops."""
        if self.misses is not None:
            self.misses.keep = {request_id} if request_id else set()
        r = snap.request(request_id) if snap is not None and request_id else None
        if r is None:
            return "prefix cache: select a request"
        if not self.prefix_caching:
            return CACHING_OFF
        if self.misses is None or request_id not in self.misses.misses:
            if self.misses is not None and self.misses.dropped and r.status != "WAITING":
                return (
                    f"prefix cache: request {request_id}'s explanation is no longer kept "
                    f"({misses_text(self.limits.miss_explanations)})"
                )
            made = next((c for c in ENGINE_MADE if c in request_id), None)
            if made is not None:  # a sample, fork or beam: made by the engine from its parent, never admitted
                kind = MADE_AS[made]
                parent = r.parent_id or request_id.split(made)[0]
                return (
                    f"prefix cache: request {request_id} is {kind} of request {parent}: it starts from its "
                    f"parent's blocks (shared, ref count > 1) and makes no prefix-cache lookup of its own"
                )
            if r.status == "WAITING":
                return f"prefix cache: request {request_id} is waiting: it has not been admitted yet"
            return f"prefix cache: request {request_id} has not been admitted yet"
        hit = hit_line(r, snap.block_size)
        miss = self.misses.misses[request_id]
        if miss is None:
            return f"{hit}: every full block of the prompt was found"
        if miss.group is not None:  # a hybrid model: the group that missed, and what each group alone would hit
            reach = ", ".join(f"{name_of(self.kv_groups, g)} {n}" for g, n in enumerate(miss.group_hits))
            where = f" in {name_of(self.kv_groups, miss.group)}" + (
                f" (each group's own hit: {reach})" if reach else ""
            )
            return f"{hit}. First miss{where}, block {miss.block_index} ({miss.reason}): {miss.detail}"
        return f"{hit}. First miss, block {miss.block_index} ({miss.reason}): {miss.detail}"

    def explained(self, snap: KVSnapshot | None, request_id: str) -> tuple[CacheMiss | None, str] | None:
        """(its first miss, None where every full block hit; the line of its hits) for an admitted request whose
        explanation is kept, else None (``miss_text`` says why in words)."""
        r = snap.request(request_id) if snap is not None and request_id else None
        if r is None or not self.prefix_caching or self.misses is None or request_id not in self.misses.misses:
            return None
        return self.misses.misses[request_id], hit_line(r, snap.block_size)

    def story(self, block_id: int, history: RunHistory, up_to: int | None = None) -> list[StoryLine]:
        steps = [s for s in history.steps if up_to is None or s <= up_to]
        lines = block_story(block_id, ((s, history.events_at(s)) for s in steps), self.decode)
        if len(self.kv_groups) < 2:
            return lines
        # a hybrid model: each line that gives the block to a request or stores it names the KV cache group it
        # went to (the group whose table held it after that step; a block changes groups as the pool reuses it)
        out = []
        for line in lines:
            snap = history.at(line.step) if line.kind in GROUP_LINES else None
            g = snap.group_of(block_id) if snap is not None else -1
            out.append(replace(line, text=f"{line.text} · {name_of(self.kv_groups, g)}") if g >= 0 else line)
        return out


def hit_line(r, block_size: int) -> str:
    """How many of a request's prompt tokens came from the prefix cache."""
    return (
        f"prefix cache: {r.num_cached_tokens} of {r.num_prompt_tokens} prompt tokens hit "
        f"({r.num_cached_tokens // block_size} block(s))"
    )


def comparison_prompts(history: RunHistory) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The prompts of the run's own requests (not the engine-made children), in arrival order, and the
    longest output seen (so the comparison runs as far as the run did)."""
    rows = sorted(
        (tl for rid, tl in history.requests.items() if not any(c in rid for c in ENGINE_MADE)), key=lambda tl: tl.index
    )
    prompts = tuple(tuple(tl.tokens[: tl.num_prompt_tokens]) for tl in rows if tl.num_prompt_tokens)
    longest = max((max(tl.num_output, default=0) for tl in rows), default=0)
    return prompts, max(1, min(longest, 64))
