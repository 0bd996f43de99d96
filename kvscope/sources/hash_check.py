"""Can this instance's block hashes be computed from tokens? Checked on the blocks it publishes, not assumed.

A router scores a prompt by hashing its tokens as the instance does; a wrong algorithm, seed or block size gives
hashes that never match, which would read as "nothing cached" everywhere. So every block an instance stores is
hashed again here from its tokens and its parent's digest (``VllmBlockHasher``) and compared with the hash it
published (the low 64 bits). A prompt's first block needs no parent, so the first one already settles it; with
``hash_algo = "auto"`` the first block also says which of vLLM's algorithms the instance uses. Until a block
settles it, or once blocks fail to reproduce, ``why_not`` says so in one line and the instance is not scored.
No sockets here.
"""

from __future__ import annotations

from engine.core.vllm_hashing import (
    REPRODUCIBLE,
    VLLM_DEFAULT_SEED,
    VLLM_HASH_ALGOS,
    VllmBlockHasher,
    low64,
    not_reproducible,
)
from engine.inspect.kv_events import ExternalHash
from kvscope.messages import count_text
from kvscope.sources.remote_cache import ForestNode

_MASK = (1 << 64) - 1


def published_low64(h: ExternalHash) -> int:
    """A published hash's low 64 bits: vLLM's int, SGLang's signed int, or the digest's bytes."""
    return int.from_bytes(h, "big") & _MASK if isinstance(h, bytes) else h & _MASK


class HashCheck:
    """One instance's hashing, learnt from its blocks (a ``CacheListener`` of its model)."""

    def __init__(
        self, algo: str = "auto", seed: str | None = None, block_size: int | None = None, max_digests: int = 200_000
    ) -> None:
        self.seed = seed if seed is not None else VLLM_DEFAULT_SEED
        self.seed_given = seed is not None
        self.block_size = block_size  # expected; None: the events' own
        self.algo = algo
        self.fatal = not_reproducible(algo, seed_known=self.seed_given) if algo != "auto" else None
        # "auto" tries every algorithm this seed can reproduce (xxHash only with the instance's PYTHONHASHSEED)
        auto = VLLM_HASH_ALGOS if self.seed_given else REPRODUCIBLE
        self.candidates = (
            [] if self.fatal else [VllmBlockHasher(a, self.seed) for a in (auto if algo == "auto" else (algo,))]
        )
        self.scheme: VllmBlockHasher | None = None  # the hashing its blocks confirmed
        self.event_block_size: int | None = None  # what its events say
        self.reproduced = 0
        self.failed = 0
        self.unchecked = 0  # blocks whose tokens or parent digest were not at hand
        self.max_digests = max_digests
        self._digests: dict[tuple[int, ExternalHash], bytes] = {}  # reproduced blocks' full digests, per rank

    # -- CacheListener ----------------------------------------------------------------------
    def block_added(self, rank: int, medium: str, node: ForestNode) -> None:
        if self.fatal:
            return
        toks = node.token_ids
        if self.event_block_size is None:
            self.event_block_size = node.num_tokens
        if self.block_size is not None and node.num_tokens != self.block_size:
            self.fatal = (
                f"its blocks hold {node.num_tokens} tokens, not the block size {self.block_size} it was "
                f"given: give block_size {node.num_tokens}"
            )
            return
        parent = None
        if node.parent is not None:
            parent = self._digests.get((rank, node.parent))
            if parent is None:  # its parent was stored before kvscope attached, or not reproduced
                self.unchecked += 1
                return
        if not toks:
            self.unchecked += 1
            return
        want = published_low64(node.block_hash)
        for c in [self.scheme] if self.scheme else self.candidates:
            digest = c.hash_block(parent, toks)
            if low64(digest) == want:
                self.scheme = c
                self.reproduced += 1
                if len(self._digests) < self.max_digests:
                    self._digests[(rank, node.block_hash)] = digest
                return
        self.failed += 1

    def block_removed(self, rank: int, medium: str, node: ForestNode) -> None:
        self._digests.pop((rank, node.block_hash), None)

    # -- the verdict ------------------------------------------------------------------------
    @property
    def effective_block_size(self) -> int | None:
        return self.block_size or self.event_block_size

    def why_not(self) -> str | None:
        """Why this instance cannot be scored (one line), or None when its hashes were reproduced."""
        if self.fatal:
            return self.fatal
        if self.scheme is not None:
            return None
        if self.failed:
            tried = " or ".join(c.algo for c in self.candidates)
            seed = f"seed {self.seed!r}" if self.seed_given else f"seed {self.seed!r} (PYTHONHASHSEED unset)"
            return (
                f"its hashes are not vLLM's {tried} with {seed}: give its hash_seed (its PYTHONHASHSEED), or "
                f"start it with --prefix-caching-hash-algo sha256_cbor (kvscope: --hash-algo sha256_cbor)"
            )
        return "no first block of a prompt seen yet: its hashing is not known"

    def describe(self) -> str:
        """The verdict as the fleet view shows it."""
        why = self.why_not()
        if why:
            return f"not reproducible: {why}" if self.failed or self.fatal else why
        text = f"{self.scheme.algo}, seed {self.scheme.seed!r}: {count_text(self.reproduced, 'block')} reproduced"
        return text + (f", {self.failed} not (extra keys: LoRA, images or a cache salt)" if self.failed else "")

    def as_dict(self) -> dict:
        return {
            "reproducible": self.scheme is not None and not self.fatal,
            "algo": self.scheme.algo if self.scheme else self.algo,
            "seed": self.scheme.seed if self.scheme else self.seed,
            "block_size": self.effective_block_size,
            "blocks_reproduced": self.reproduced,
            "blocks_not_reproduced": self.failed,
            "blocks_unchecked": self.unchecked,
            "why_not": self.why_not(),
        }
