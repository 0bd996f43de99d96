"""Why did this request miss the prefix cache? Read from the event stream, at each request's admission.

The explainer mirrors the cache from ``stored`` / ``evicted`` / ``unpublished`` / ``reset`` events (each
stored block with its tokens and its parent's hash), walks the request's prompt along the blocks it hit,
and names the reason for the first block that missed:

- ``prompt_ends_in_block``: the block holds the prompt's last token (only full blocks are cached, and
  the last prompt token is always computed: its logits are needed);
- ``evicted``: this very block (same tokens after the same chain) was cached and evicted at step s;
- ``different_identity``: the same tokens after the same chain are cached, but under other extra keys
  (a different cache salt, model or tokenizer): the hashes differ;
- ``different_tokenization``: a cached chain continues where the prompt does, with the same text but
  other token ids (special tokens, a template change);
- ``shifted``: a block of a cached chain (its next block, or one further down the chain) appears in the
  prompt k tokens away from where the chain puts it: tokens put in front (a request id or a timestamp
  before a shared system prompt, the commonest real cause of a low hit rate) moved every block boundary,
  so no block hashes as before. Text put in front often changes the token at the seam too (BPE: "You"
  becomes " You" after "session 42."), so the chain's first block never reappears: then the shift is
  found on a later block and the detail names the seam, the tokens that differ at the boundary;
- ``differs_at``: a cached chain continues there but its tokens differ from token position p on (a
  timestamp or a session id inside a system prompt);
- ``no_cached_block``: nothing cached continues the chain at that position.

The pool publishes a block when its step is scheduled (as vLLM does: a request admitted later in the
same step hits it), and a failed step withdraws it, so each admission is judged against the cache as the
events so far left it.

What it remembers can be bounded (a window left open on a served engine): ``max_requests`` explanations
(the oldest dropped first, never those in ``keep``) and ``max_evicted`` evicted blocks (the oldest
dropped first: a block evicted before them is then told as ``no_cached_block``). The mirror and the ref
counts are bounded by the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

from .cache_rules import CacheChange, cache_change
from .events import (
    BlockAllocated,
    BlockEvicted,
    BlockFreed,
    BlockStored,
    BlockTouched,
    BlockUnpublished,
    Event,
    RequestAdmitted,
)
from .kv_groups import hash_group

Decode = Callable[[list[int]], "str | None"]
CONTEXT = 12  # characters of text shown on each side of the differing position
MARK = ("⟦", "⟧")  # around the token that differs, in a detail's text
MAX_SHIFT = 512  # the longest run of tokens put in front of a cached chain that ``shifted`` looks for


@dataclass(frozen=True, slots=True)
class _Cached:
    block_hash: str
    parent_hash: str | None
    tokens: tuple[int, ...]
    block_id: int


@dataclass(frozen=True, slots=True)
class SeamSide:
    """One side of where a miss begins, as text: what comes before the token that differs, the token, what follows
    (the window shows the prompt's side and the cache's side by side)."""

    before: str
    token: str
    after: str
    token_id: int


@dataclass(frozen=True, slots=True)
class CacheMiss:
    block_index: int  # the request's first logical block that was not a hit
    reason: str
    token_position: int  # the prompt position where the miss begins
    detail: str
    evicted_at: int | None = None
    shift: int | None = None  # ``shifted``: how many tokens later (negative: earlier) the cached chain sits
    seam: int | None = None  # ``shifted`` at a changed seam: the prompt position where it agrees with the chain again
    # ``differs_at`` and ``shifted`` at a seam: the token that differs, in the prompt and in the cache (with text)
    prompt_side: SeamSide | None = None
    cached_side: SeamSide | None = None
    group: int | None = None  # a hybrid model's KV cache group that missed (cache_miss_groups.py)
    group_hits: tuple[int, ...] = ()  # each group's own hit, in tokens

    def to_dict(self) -> dict:
        return {
            **({"group": self.group, "group_hits": list(self.group_hits)} if self.group is not None else {}),
            "block_index": self.block_index,
            "reason": self.reason,
            "token_position": self.token_position,
            "detail": self.detail,
            "evicted_at": self.evicted_at,
            "shift": self.shift,
            "seam": self.seam,
        }


class CacheMissExplainer:
    """Feed ``(step, events, prompts)`` in order, where ``prompts`` maps request ids to prompt token ids
    (what the snapshot after the step holds); ``misses`` holds each admitted request's first miss."""

    def __init__(
        self,
        block_size: int,
        decode: Decode | None = None,
        max_requests: int | None = None,
        max_evicted: int | None = None,
        group: int | None = None,
    ) -> None:
        """``max_requests``, ``max_evicted``: how many explanations and evicted blocks to keep (None: all);
        ``group``: a hybrid model's KV cache group whose cached blocks alone it follows (None: every block)."""
        self.block_size = block_size
        self.group = group
        self.decode = decode
        self.max_requests, self.max_evicted = max_requests, max_evicted
        self.mirror: dict[str, _Cached] = {}
        # evicted blocks by (parent hash, tokens), each with the step it went at; the newest key last
        self.evicted: OrderedDict[tuple[str | None, tuple[int, ...]], list[tuple[int, _Cached]]] = OrderedDict()
        self.num_evicted = 0  # blocks in ``evicted``
        self.ref: dict[int, int] = {}
        self.misses: dict[str, CacheMiss | None] = {}  # in admission order
        self.keep: set[str] = set()  # explanations never dropped (the window's selected request)
        self.dropped = 0  # explanations dropped by the bound

    def feed_snapshot(self, step: int, events: Iterable[Event], snap) -> None:
        """``feed`` with the prompts of the snapshot after the step (sliced only in a step that admits)."""
        self.feed(step, events, lambda: {r.request_id: r.token_ids[: r.num_prompt_tokens] for r in snap.requests})

    def feed(
        self,
        step: int,
        events: Iterable[Event],
        prompts: dict[str, tuple[int, ...]] | Callable[[], dict[str, tuple[int, ...]]],
    ) -> None:
        """``prompts``: the mapping, or a callable that builds it (called only in a step that admits)."""
        admitted: list[tuple[RequestAdmitted, dict[str, _Cached]]] = []
        mirror = self.mirror
        own: dict[str, list[str]] = {}  # the hashes each request stored in this step, before its admission
        group = self.group
        for e in events:
            change = cache_change(e)  # the prefix cache's rules: engine.inspect.cache_rules
            if group is not None and change in _KEYED and hash_group(cast(BlockStored, e).block_hash) != group:
                continue  # another group's block (its key carries its group)
            if change is CacheChange.STORED:  # visible at once: a later admission in this step hits it
                e = cast(BlockStored, e)
                mirror[e.block_hash] = _Cached(e.block_hash, e.parent_hash, tuple(e.token_ids), e.block_id)
                own.setdefault(e.request_id, []).append(e.block_hash)
            elif change is CacheChange.EVICTED:
                gone = mirror.pop(cast(BlockEvicted, e).block_hash, None)
                if gone is not None:
                    self._remember_eviction(step, gone)
            elif change is CacheChange.WITHDRAWN:
                mirror.pop(cast(BlockUnpublished, e).block_hash, None)
            elif change is CacheChange.CLEARED:
                mirror.clear()
            elif isinstance(e, BlockAllocated):
                self.ref[e.block_id] = 1
            elif isinstance(e, (BlockTouched, BlockFreed)):
                self.ref[e.block_id] = e.ref_cnt
            elif isinstance(e, RequestAdmitted) and e.request_id not in self.misses:
                view = dict(mirror)
                for h in own.pop(e.request_id, ()):  # its own blocks, stored as it was scheduled, never hit it
                    view.pop(h, None)
                admitted.append((e, view))
        table = prompts() if admitted and callable(prompts) else prompts
        for e, view in admitted:
            assert not callable(table)  # built above when anything was admitted
            prompt = table.get(e.request_id)
            if prompt is not None:
                self.misses[e.request_id] = self.explain(tuple(prompt), e.num_cached_tokens, view)
        excess = len(self.misses) - self.max_requests if self.max_requests is not None else 0
        if excess > 0:  # the oldest go, never one in ``keep``
            drop: list[str] = []
            for rid in self.misses:
                if len(drop) >= excess:
                    break
                if rid not in self.keep:
                    drop.append(rid)
            for rid in drop:
                del self.misses[rid]
            self.dropped += len(drop)

    def _remember_eviction(self, step: int, gone: _Cached) -> None:
        key = (gone.parent_hash, gone.tokens)
        was = self.evicted.pop(key, [])
        now = [x for x in was if x[1].block_hash != gone.block_hash] + [(step, gone)]  # a block's latest eviction
        self.evicted[key] = now
        self.num_evicted += len(now) - len(was)
        if self.max_evicted is not None:
            while self.num_evicted > self.max_evicted and self.evicted:
                self.num_evicted -= len(self.evicted.popitem(last=False)[1])

    # -- the diagnosis ---------------------------------------------------------------------------
    def explain(self, prompt: tuple[int, ...], num_hit_tokens: int, view: dict[str, _Cached]) -> CacheMiss | None:
        bs = self.block_size
        i = num_hit_tokens // bs
        pos = i * bs
        if pos >= len(prompt):
            return None
        # the chain of blocks the request hit, by content, so a salted twin is not mistaken for it
        children: dict[str | None, list[_Cached]] = {}
        for c in view.values():
            children.setdefault(c.parent_hash, []).append(c)
        parents: list[str | None] = [None]
        for j in range(i):
            want = prompt[j * bs : (j + 1) * bs]
            parents = [c.block_hash for p in parents for c in children.get(p, []) if c.tokens == want]
        block = prompt[pos : pos + bs]
        if pos + bs >= len(prompt):
            n = len(prompt) - pos
            return CacheMiss(
                i,
                "prompt_ends_in_block",
                pos,
                f"block {i} holds the prompt's last {n} token(s): only full blocks are cached and "
                f"the last prompt token is always computed",
            )
        gone = [
            x for p in dict.fromkeys(parents) for x in self.evicted.get((p, block), ()) if x[1].block_hash not in view
        ]
        if gone:
            step, c = max(gone, key=lambda x: x[0])  # the latest eviction
            return CacheMiss(
                i,
                "evicted",
                pos,
                f"block {i} was cached (physical block {c.block_id}) and evicted at step {step}",
                evicted_at=step,
            )
        nexts = [c for p in parents for c in children.get(p, [])]
        if any(c.tokens == block for c in nexts):
            return CacheMiss(
                i,
                "different_identity",
                pos,
                f"the first {pos + bs} tokens are cached, but under other extra keys "
                f"(a different cache salt, model or tokenizer), so their hashes differ",
            )
        if not nexts:
            where = "at the start" if i == 0 else f"after block {i - 1}"
            return CacheMiss(i, "no_cached_block", pos, f"nothing cached continues the prompt {where}")
        best, common = max(((c, _common(c.tokens, block)) for c in nexts), key=lambda t: t[1])
        p = pos + common
        if self._same_text(prompt, pos, best, children):  # before a shift: other ids move later blocks too
            return CacheMiss(
                i,
                "different_tokenization",
                p,
                "a cached chain holds the same text with other token ids from position "
                f"{p} (special tokens or a template change)",
            )
        shift = self._shift(prompt, pos, nexts, children)
        if shift is not None:
            return self._shifted(prompt, i, pos, *shift)
        cached = prompt[:pos] + best.tokens
        return CacheMiss(
            i,
            "differs_at",
            p,
            f"a cached chain differs from the prompt at token {p}: "
            f"prompt {self._around(prompt, p)} vs cached {self._around(cached, p)}",
            prompt_side=self._side(prompt, p),
            cached_side=self._side(cached, p),
        )

    def _shift(
        self, prompt: tuple[int, ...], pos: int, nexts: list[_Cached], children: dict[str | None, list[_Cached]]
    ) -> tuple[int, int, tuple[int, ...]] | None:
        """Where a cached chain reappears moved: ``(k, depth, chain)`` for the shallowest block of the chains that
        continue at ``pos`` (its next block, else one further down, up to ``MAX_SHIFT`` tokens on) found in the
        prompt ``k != 0`` tokens from where its chain puts it; ``chain``: that chain's tokens from ``pos`` to the
        block's end. Of several, the chain that agrees with the prompt the longest (the earliest seam, then the
        longest common start), then the smallest ``|k|``. None: no block of them reappears moved."""
        bs = self.block_size
        where: dict[tuple[int, ...], list[int]] = {}  # each window of the prompt from pos: one pass, not one a depth
        for q in range(pos, len(prompt) - bs + 1):
            where.setdefault(prompt[q : q + bs], []).append(q)
        level: list[tuple[_Cached, tuple | None]] = [(c, None) for c in nexts]  # (block, its parent's entry)
        for depth in range(MAX_SHIFT // bs + 1):
            at = pos + depth * bs  # where the chain puts a block of this depth
            if not level or at > len(prompt) + MAX_SHIFT:
                return None
            found: list[tuple[tuple, tuple]] = []
            for entry in level:
                if len(set(entry[0].tokens)) < 2:  # a run of one token matches anywhere
                    continue
                for q in where.get(entry[0].tokens, ()):
                    if q == at or abs(q - at) > MAX_SHIFT:
                        continue
                    chain: tuple[int, ...] = ()
                    e: tuple | None = entry
                    while e is not None:
                        chain, e = e[0].tokens + chain, e[1]
                    seam, _ = _seam(prompt, pos, chain, q, depth * bs)
                    found.append(((seam, -_common(prompt[pos:], chain), abs(q - at), at - q), (q - at, depth, chain)))
            if found:
                return min(found, key=lambda t: t[0])[1]
            level = [(n, entry) for entry in level for n in children.get(entry[0].block_hash, ())]
        return None

    def _shifted(
        self, prompt: tuple[int, ...], i: int, pos: int, k: int, depth: int, chain: tuple[int, ...]
    ) -> CacheMiss:
        """The miss of a shifted chain; past its first block, the seam: where the prompt and the chain agree
        again (walking back from the block that reappears) and the tokens that differ just before."""
        bs = self.block_size
        if depth == 0:  # a whole-token shift: the chain's own next block is there, k tokens on
            if i == 0 and k > 0:
                said = f"a prefix of {k} token(s) shifted the rest: the cached chain starts at token {k}"
            else:
                said = (
                    f"{abs(k)} token(s) {'put in' if k > 0 else 'taken out'} at token {pos} shifted the rest: "
                    f"the cached chain continues at token {pos + k}"
                )
            return CacheMiss(
                i, "shifted", pos, said + " (every block boundary moved, so no block hashes alike)", shift=k
            )
        q, c = _seam(prompt, pos, chain, pos + depth * bs + k, depth * bs)
        full = prompt[:pos] + chain  # the cached tokens, from the start of the prompt
        return CacheMiss(
            i,
            "shifted",
            pos,
            f"the cached chain reappears {abs(k)} token(s) {'later' if k > 0 else 'earlier'} from "
            f"token {q} on, but the seam changed: the token before it is {self._show(prompt[q - 1 : q])} "
            f"in the prompt, {self._show(full[pos + c - 1 : pos + c])} in the cache (prompt "
            f"{self._around(prompt, q)} vs cached {self._around(full, pos + c)}): text put in front "
            f"changed how the boundary tokenizes (in BPE a word after a space is another token), so "
            f"block {i} never reappears and every block boundary after it moved: no block hashes alike",
            shift=k,
            seam=q,
            prompt_side=self._side(prompt, q - 1),
            cached_side=self._side(full, pos + c - 1),
        )

    def _show(self, ids: tuple[int, ...]) -> str:
        """Tokens as their text (and ids), or as ids without a tokenizer."""
        text = self.decode(list(ids)) if self.decode is not None and ids else None
        return f"{text!r} {list(ids)}" if text is not None else str(list(ids))

    def _same_text(self, prompt, pos, cached: _Cached, children) -> bool:
        if self.decode is None:
            return False
        tail = list(cached.tokens)  # the cached chain from this block on, as far as it goes
        node = cached
        while len(tail) < 4 * self.block_size and children.get(node.block_hash):
            node = children[node.block_hash][0]
            tail += node.tokens
        a, b = self.decode(list(prompt[pos:])), self.decode(tail)
        if not a or not b or list(prompt[pos : pos + len(tail)]) == tail:
            return False
        n = min(len(a), len(b))
        return n > 0 and a[:n] == b[:n]

    def _around(self, tokens, p: int) -> str:
        """The text around position ``p`` with the token there in ``MARK`` brackets (not "|": a chat template's
        ``<|im_end|>`` has pipes of its own)."""
        if self.decode is None:
            return str(list(tokens[max(0, p - 3) : p + 3]))
        side = self._side(tokens, p)
        if side is None:  # past the prompt's end
            return ""
        return repr(f"{side.before}{MARK[0]}{side.token}{MARK[1]}{side.after}")

    def _side(self, tokens, p: int) -> SeamSide | None:
        """The text before token ``p``, the token and the text after it (token ids where there is no tokenizer)."""
        if not 0 <= p < len(tokens):
            return None
        if self.decode is None:
            ids = list(tokens)
            return SeamSide(str(ids[max(0, p - 3) : p])[1:-1], str(ids[p]), str(ids[p + 1 : p + 4])[1:-1], ids[p])
        whole = self.decode(list(tokens[: p + 1])) or ""
        before = self.decode(list(tokens[:p])) or ""
        token = whole[len(before) :] if whole.startswith(before) else (self.decode([tokens[p]]) or "")
        after = (self.decode(list(tokens[: p + 7])) or "")[len(whole) :]
        return SeamSide(before[-CONTEXT:], token, after[:CONTEXT], int(tokens[p]))


_KEYED = (CacheChange.STORED, CacheChange.EVICTED, CacheChange.WITHDRAWN)


def _seam(prompt: tuple[int, ...], pos: int, chain: tuple[int, ...], q: int, c: int) -> tuple[int, int]:
    """Walk back from ``prompt[q:]`` matching ``chain[c:]`` (``chain`` starts at prompt position ``pos``) while the
    tokens agree: ``(q, c)`` where the agreement begins, the seam."""
    while q > pos and c > 0 and prompt[q - 1] == chain[c - 1]:
        q, c = q - 1, c - 1
    return q, c


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
