"""The best hit rate a workload allows: its own prefix sharing, computed apart from the engine.

With a pool that never evicts and one request at a time (Mooncake's Table 2 "cache ratio"), request
*i* finds cached exactly the longest prefix of its blocks that an earlier request also had, by the
engine's rules: only full blocks (of the engine's block size) are cached, and the prompt's last
token is always computed (its logits are needed), so at most ``(prompt_len - 1) // block_size``
blocks hit.

Nothing here touches the engine, its hashes or its tokens: Mooncake requests are walked by hash
ids. A hash id covers 512 tokens, so an engine block is (its id's chain, its index inside the id's
block); a tree with one node per distinct chain of ids remembers how many full engine blocks of that
id any request has had (``fill``). Requests given as token ids are walked by their blocks' tokens.

``round_robin_sharing`` is the same over a fleet behind a round-robin router: each instance a pool that
never evicts over every N-th request (what the fleet's engines must cache, one request at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

from .reader import TraceRequest, Workload


@dataclass(frozen=True, slots=True)
class Reference:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    blocks_allocated: int  # blocks the engine takes in all (hits excluded): a pool this large never evicts

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_sharing(workload: Workload, block_size: int, max_prompt_len: int | None = None) -> Reference:
    """The reference over every request (or those shorter than ``max_prompt_len``, as the engine skips
    a prompt of the context's length or more)."""
    return _sharing(workload, _runnable(workload, max_prompt_len), block_size)


def round_robin_sharing(
    workload: Workload, instances: int, block_size: int, max_prompt_len: int | None = None
) -> list[Reference]:
    """Round robin over ``instances`` pools that never evict, one request at a time: the k-th request the
    engine runs goes to instance k mod N, and finds cached what an earlier request of its own instance had.
    One ``Reference`` per instance (their sum is the fleet's)."""
    reqs = _runnable(workload, max_prompt_len)
    return [_sharing(workload, reqs[i::instances], block_size) for i in range(instances)]


def _runnable(workload: Workload, max_prompt_len: int | None) -> list[TraceRequest]:
    return [r for r in workload.requests if max_prompt_len is None or r.prompt_len < max_prompt_len]


def _sharing(workload: Workload, reqs: list[TraceRequest], block_size: int) -> Reference:
    if workload.format == "mooncake":
        cached = _by_hash_ids(reqs, block_size, workload.hash_block_size)
    else:
        cached = _by_tokens(reqs, block_size)
    prompt = sum(r.prompt_len for r in reqs)
    hits = sum(cached)
    # each request takes blocks for its prompt and its one (uncounted) sampled token, minus its hits
    allocated = sum(-(-(r.prompt_len + 1) // block_size) for r in reqs) - hits // block_size
    return Reference(len(reqs), prompt, hits, allocated)


def _by_hash_ids(reqs: list[TraceRequest], bs: int, hash_block: int) -> list[int]:
    per = hash_block // bs  # engine blocks in one hash block
    node_of: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node; the root is -1
    fill: list[int] = []  # node -> most full engine blocks of its hash block any request had
    out = []
    for r in reqs:
        n, ids = r.prompt_len, r.hash_ids or ()  # a Mooncake request's (the caller checked)
        full = n // bs  # full engine blocks of the prompt
        hit, node = 0, -1
        for j, h in enumerate(ids):  # the longest cached prefix, in engine blocks
            child = node_of.get((node, h))
            if child is None:
                break
            here = min(per, full - j * per)
            got = min(fill[child], here)
            hit += got
            if got < per:
                break
            node = child
        out.append(min(hit, (n - 1) // bs) * bs)
        node = -1
        for j, h in enumerate(ids):  # then every full block of this prompt is cached
            here = min(per, full - j * per)
            if here <= 0:
                break
            child = node_of.get((node, h))
            if child is None:
                child = node_of[(node, h)] = len(fill)
                fill.append(0)
            fill[child] = max(fill[child], here)
            node = child
    return out


def _by_tokens(reqs: list[TraceRequest], bs: int) -> list[int]:
    node_of: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent node, a block's tokens) -> node
    out = []
    for r in reqs:
        ids = r.token_ids or []  # a token-id request's (the caller checked)
        full = len(ids) // bs
        keys = [tuple(ids[i * bs : (i + 1) * bs]) for i in range(full)]
        hit, node = 0, -1
        for k in keys[: (len(ids) - 1) // bs]:
            child = node_of.get((node, k))
            if child is None:
                break
            hit, node = hit + 1, child
        out.append(hit * bs)
        node = -1
        for k in keys:
            node = node_of.setdefault((node, k), len(node_of))
    return out
