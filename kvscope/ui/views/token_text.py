"""Tokens as short labels for slots and cells, and which tokens sit in which block."""

from __future__ import annotations

from collections.abc import Callable

from engine.inspect.snapshot import KVSnapshot, RequestInfo

Decode = Callable[[list[int]], str]


def token_label(text: str) -> str:
    """A token's text for a slot: surrounding spaces dropped, whitespace made visible."""
    if text == "":
        return "∅"
    s = text.strip(" ")
    if s == "":
        return "␣"
    return s.replace("\n", "⏎").replace("\t", "⇥").replace("\r", "")


class TokenDecoder:
    """Decodes one token at a time (for slots) with a cache; without a tokenizer a token is its id."""

    def __init__(self, decode: Decode | None = None) -> None:
        self.decode = decode
        self._cache: dict[int, str] = {}

    def set_decode(self, decode: Decode | None) -> None:
        self.decode = decode
        self._cache.clear()

    def text(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            if self.decode is None:
                t = str(token_id)
            else:
                try:
                    t = self.decode([int(token_id)])
                except Exception:  # noqa: BLE001 - a bad id must not break a paint
                    t = f"<{token_id}>"
            self._cache[token_id] = t
        return t

    def label(self, token_id: int) -> str:
        return token_label(self.text(token_id)) if self.decode is not None else str(token_id)

    def join(self, token_ids) -> str:
        ids = [int(t) for t in token_ids]
        if self.decode is None:
            return " ".join(map(str, ids))
        try:
            return self.decode(ids)
        except Exception:  # noqa: BLE001
            return " ".join(map(str, ids))


def request_block_tokens(r: RequestInfo, i: int, block_size: int) -> tuple[int, ...]:
    """The tokens whose KV sits in logical block ``i`` of request ``r`` (computed tokens only)."""
    lo = i * block_size
    return tuple(r.token_ids[lo : min(lo + block_size, r.num_computed_tokens)])


def request_filled(r: RequestInfo, i: int, block_size: int) -> int:
    """# filled slots of logical block ``i`` (the paper's block-table column)."""
    return max(0, min(block_size, r.num_computed_tokens - i * block_size))


class BlockTokens:
    """Which tokens each physical block holds in one snapshot (first holder wins; cached blocks by hash)."""

    def __init__(self, snap: KVSnapshot) -> None:
        self.snap = snap
        self._where: dict[int, tuple[RequestInfo, int]] | None = None

    def _index(self) -> dict[int, tuple[RequestInfo, int]]:
        if self._where is None:
            where: dict[int, tuple[RequestInfo, int]] = {}
            for r in self.snap.requests:
                for i, b in enumerate(r.block_ids):
                    where.setdefault(b, (r, i))
            self._where = where
        return self._where

    def of(self, b: int) -> tuple[int, ...]:
        hit = self._index().get(b)
        if hit is not None:
            return request_block_tokens(hit[0], hit[1], self.snap.block_size)
        return tuple(self.snap.cached_tokens.get(b, ()))

    def holder(self, b: int) -> RequestInfo | None:
        hit = self._index().get(b)
        return hit[0] if hit else None
