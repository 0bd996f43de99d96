"""Where would this prompt go: each instance's longest cached prefix of a prompt, in blocks.

This is the score a precise prefix-aware router computes (llm-d's precise prefix-cache scorer, Dynamo's KV router):
hash the prompt's full blocks as the instance does, then count from the first block how many in a row the
instance holds (a hit needs every block before it: a block's hash names its whole prefix). kvscope only answers;
it does not route. An instance whose hashing is not known or not reproducible is said in one line, never counted
as holding nothing; an instance that holds no block at all scores 0 whatever its hashing. No sockets here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.vllm_hashing import low64
from kvscope.sources.hash_check import HashCheck
from kvscope.sources.remote_cache import RemoteCacheModel


@dataclass(frozen=True)
class RouteScore:
    instance: str
    blocks: int | None  # the longest cached prefix in blocks; None: not scored (``note`` says why)
    block_size: int | None
    prompt_blocks: int | None  # the prompt's full blocks at this instance's block size
    up: bool  # connected to its publisher now
    note: str = ""  # one line: why it was not scored
    path: tuple[int, ...] = ()  # the prompt's block hashes as this instance publishes them (low 64 bits)

    @property
    def tokens(self) -> int | None:
        return None if self.blocks is None or self.block_size is None else self.blocks * self.block_size

    def as_dict(self) -> dict:
        return {
            "instance": self.instance,
            "blocks": self.blocks,
            "tokens": self.tokens,
            "prompt_blocks": self.prompt_blocks,
            "block_size": self.block_size,
            "up": self.up,
            "note": self.note or None,
        }


@dataclass(frozen=True)
class RouteAnswer:
    prompt_tokens: int
    scores: tuple[RouteScore, ...]

    @property
    def best(self) -> tuple[str, ...]:
        """The instances up now with the longest cached prefix in tokens (several: a tie; none: nothing cached)."""
        scored = [s for s in self.scores if s.up and s.tokens]
        if not scored:
            return ()
        top = max(s.tokens for s in scored)
        return tuple(s.instance for s in scored if s.tokens == top)

    def line(self) -> str:
        """The answer in one line."""
        best = self.best
        if best:
            s = next(s for s in self.scores if s.instance == best[0])
            where = best[0] if len(best) == 1 else f"a tie between {', '.join(best)} (a router breaks it by load)"
            return (
                f"{where}: {s.blocks} of its {s.prompt_blocks} full blocks cached ({s.tokens} of "
                f"{self.prompt_tokens} prompt tokens)"
            )
        if not any(s.blocks is not None for s in self.scores):
            notes = {s.note for s in self.scores}
            if len(notes) == 1:
                return f"no instance could be scored: {notes.pop()}"
            return "no instance could be scored: " + "; ".join(f"{s.instance}: {s.note}" for s in self.scores)
        return f"no instance holds its first block ({self.prompt_tokens} tokens): a router sends it by load alone"

    @property
    def path(self) -> set[int]:
        """Every scored instance's hashes of the prompt (one chain when they all hash alike): what to ring."""
        return {h for s in self.scores for h in s.path}

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "best": list(self.best),
            "answer": self.line(),
            "instances": [s.as_dict() for s in self.scores],
        }


def longest_prefix(model: RemoteCacheModel, hashes: Sequence[bytes]) -> int:
    """How many of ``hashes`` (a prompt's digests, first block first) one model holds in a row from the start, on
    its best data-parallel rank, in any medium. Published hashes are the low 64 bits, or the whole digest."""
    media: dict[int, list[str]] = {}
    for rank, medium in model.tier_blocks:
        media.setdefault(rank, []).append(medium)
    best = 0
    for rank, ms in media.items():
        n = 0
        for d in hashes:
            h64 = low64(d)
            if not any((rank, m, h64) in model.nodes or (rank, m, d) in model.nodes for m in ms):
                break
            n += 1
        best = max(best, n)
    return best


def score(name: str, model: RemoteCacheModel, check: HashCheck, token_ids: Sequence[int], up: bool) -> RouteScore:
    """One instance's score for a prompt, or why it has none."""
    bs = check.effective_block_size
    prompt_blocks = len(token_ids) // bs if bs else None
    if not model.nodes:
        return RouteScore(name, 0, bs, prompt_blocks, up)  # it holds nothing: 0 whatever its hashing
    why = check.why_not()
    if why is not None:
        return RouteScore(name, None, bs, prompt_blocks, up, why)
    hashes = check.scheme.chain(list(token_ids), bs)
    return RouteScore(
        name,
        longest_prefix(model, hashes),
        bs,
        prompt_blocks,
        up,
        "" if up else "not connected now: its cache as last heard",
        tuple(low64(d) for d in hashes),
    )
