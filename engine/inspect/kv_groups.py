"""KV cache groups: the layer types of a hybrid model, each with its own tables in one block pool (vLLM's).

vLLM gives every kind of layer its own KV cache group: a Gemma-3 style model has a sliding-window group and a
full-attention group, a Mamba or gated-delta-net hybrid a state group beside an attention group. All groups
take their blocks from one ``BlockPool``; a block belongs to one group at a time, and a cached block keeps its
group in its key (vLLM appends the group's id to the hash). kvscope's own engine has one group (full
attention), so everything here is about a probed vLLM; the rules that more than one module needs live here:
a group's words, and a block hash's group.

A block hash of group 0 is its 16 hex digits, as everywhere in kvscope; a block hash of group ``g > 0`` carries
its group after them (``0123456789abcdef/g1``), so that one prefix hashed in two groups is two entries, as it
is in vLLM's hash map.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_GROUP = -1  # a block no group holds or caches (free, unhashed), in a snapshot's ``block_group``


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV cache group: its kind (``full``, ``sliding_window``, ``chunked_local``, ``mamba``, or vLLM's
    manager's class name for another), its block size in tokens, its window (sliding or chunk) in tokens, its
    layers, and a Mamba group's cache mode."""

    kind: str
    block_size: int
    window: int = 0
    layers: int = 0
    mode: str = ""

    @property
    def holds_every_token(self) -> bool:
        """A full-attention group keeps a block for every ``block_size`` tokens until the request ends."""
        return self.kind == "full"

    def label(self) -> str:
        """The group's kind in words: "full attention", "sliding window (64 tokens)", "mamba state"."""
        if self.kind == "full":
            return "full attention"
        if self.kind == "sliding_window":
            return f"sliding window ({self.window} tokens)"
        if self.kind == "chunked_local":
            return f"chunked local attention ({self.window}-token chunks)"
        if self.kind == "mamba":
            return "mamba state" + (f", {self.mode} mode" if self.mode else "")
        return self.kind

    def rules(self) -> str:
        """What this kind of group does with its blocks, for a reader (the requests panel, the docs)."""
        if self.kind == "full":
            return "a block for every block of tokens, kept until the request ends"
        if self.kind in ("sliding_window", "chunked_local"):
            return "the blocks that left the window are given back: vLLM's null block takes their place in the table"
        if self.kind == "mamba":
            return "state blocks: one running state, earlier states given back (the null block takes their place)"
        return "vLLM's own rules for this kind"


def name_of(groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup], g: int) -> str:
    """ "group 1 (full attention)"; "group 3" for a group not described."""
    return f"group {g} ({groups[g].label()})" if 0 <= g < len(groups) else f"group {g}"


def primary_group(groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup]) -> int:
    """The group whose table a request's row shows first: the first full-attention group (it holds every
    token), else group 0."""
    return next((g for g, x in enumerate(groups) if x.holds_every_token), 0)


def grouped_hash(hex_hash: str, group: int) -> str:
    """A block hash as kvscope keys it: the hash's hex, with ``/g{group}`` after it for a group other than 0."""
    return hex_hash if group == 0 else f"{hex_hash}/g{group}"


def hash_group(key: str) -> int:
    """The group of a block hash keyed by ``grouped_hash``."""
    _, sep, g = key.partition("/g")
    return int(g) if sep else 0


def hash_hex(key: str) -> str:
    """The hash's hex alone (what vLLM's KV events carry), without its group."""
    return key.partition("/g")[0]
