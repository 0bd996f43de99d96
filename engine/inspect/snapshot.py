"""``KVSnapshot``: a copy of the pool and request state that a GUI may keep and read freely."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .kv_groups import NO_GROUP, KVCacheGroup, hash_group
from .pool_ledger import PoolLedger
from .slot_init import slot_init

if TYPE_CHECKING:
    from ..core.kv_cache_manager import KVCacheManager
    from ..core.request import Request


class BlockState(enum.IntEnum):
    """Colour codes of the block grid (uint8)."""

    FREE = 0  # empty, on the free queue
    CACHED = 1  # free but still hashed: reusable until evicted
    USED = 2  # ref count 1
    SHARED = 3  # ref count > 1
    SWAPPED = 4  # a CPU-pool block holding a swapped-out request
    LEAKED = 5  # flagged by audit()
    RESERVED = 6  # never handed out, never counted as used: vLLM's null block (a table's placeholder)


@slot_init  # a snapshot makes one per live request: hundreds a step
@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    index: int
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    block_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    error: str | None = None
    group_id: str = ""
    parent_id: str | None = None
    cpu_block_ids: tuple[int, ...] = ()
    client: str = ""
    # a hybrid model's (a probed vLLM with several KV cache groups): every group's table, by group id, vLLM's null
    # block (the snapshot's ``reserved``) where a window or a state group gave a block back; () with one group
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    group_hits: tuple[int, ...] = ()  # each group's own prefix-cache hit at admission, in tokens (hybrid models)
    held_by: str = ""  # a finished request whose blocks a KV connector keeps for its transfer: why ("" if none)

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        """Every group's table (one group: ``block_ids`` alone)."""
        return self.group_block_ids or (self.block_ids,)


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    step: int
    block_size: int
    num_blocks: int
    state: np.ndarray  # uint8 [num_blocks], BlockState
    ref_cnt: np.ndarray  # int32
    owner: np.ndarray  # int32: index of the earliest owning request, -1 if none
    has_hash: np.ndarray  # bool
    last_access: np.ndarray  # int64, engine step
    filled: np.ndarray  # int16, slots holding computed KV
    free_queue: np.ndarray  # int32 block ids in eviction order
    requests: tuple[RequestInfo, ...]
    cached_tokens: Mapping[int, tuple[int, ...]]  # token ids of every hashed block
    block_hashes: Mapping[int, str]  # hex hash of every hashed block
    counters: dict[str, float]
    block_bytes: int = 0
    model_name: str = ""
    cpu_state: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # FREE or SWAPPED
    cpu_owner: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    reserved: tuple[int, ...] = ()  # blocks never handed out (vLLM's null block): state RESERVED
    num_groups: int = 1  # KV cache groups (kv_groups.py): more than one in a hybrid model
    kv_groups: tuple[KVCacheGroup, ...] = ()  # each group's kind and block size, when the source says them
    # int8 per block when num_groups > 1: the group whose table holds it, or whose key it is cached under
    # (kv_groups.NO_GROUP for none); empty with one group
    block_group: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    pinned: dict[int, int] = field(default_factory=dict)  # block -> references a KV connector holds, no table

    @property
    def num_cpu_blocks(self) -> int:
        return len(self.cpu_state)

    @property
    def block_tables(self) -> dict[str, tuple[int, ...]]:
        return {r.request_id: r.block_ids for r in self.requests}

    def owners_of(self, block_id: int) -> list[str]:
        return [r.request_id for r in self.requests if any(block_id in t for t in r.tables)]

    def group_of(self, block_id: int) -> int:
        """The KV cache group that holds or caches ``block_id`` (0 with one group; kv_groups.NO_GROUP for none)."""
        if not len(self.block_group):
            return 0
        return int(self.block_group[block_id])

    def request(self, request_id: str) -> RequestInfo | None:
        return next((r for r in self.requests if r.request_id == request_id), None)

    # -- a PoolRecord ---------------------------------------------------------------------------------------
    @property
    def state_counts(self) -> tuple[int, ...]:
        return _counts(self.state)

    has_arrays = True

    def assembled(self) -> KVSnapshot:
        return self

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in RAW_ARRAYS}

    def cache_maps(self) -> tuple[dict[int, tuple[int, ...]], dict[int, str]]:
        return dict(self.cached_tokens), dict(self.block_hashes)


def assemble_snapshot(
    step: int,
    block_size: int,
    ref_cnt: np.ndarray,
    has_hash: np.ndarray,
    last_access: np.ndarray,
    free_queue: np.ndarray,
    requests: Sequence[RequestInfo],
    cached_tokens: Mapping[int, tuple[int, ...]],
    block_hashes: Mapping[int, str],
    counters: dict,
    num_cpu_blocks: int,
    reserved: tuple[int, ...] = (),
    num_groups: int = 1,
    kv_groups: tuple[KVCacheGroup, ...] = (),
    **extra,
) -> KVSnapshot:
    """Derive the per-block views (state, owner, filled, CPU pool; with several KV cache groups, each block's
    group) from the raw pool state.

    Shared by the live engine and by trace replay, so both build identical snapshots.
    """
    n = len(ref_cnt)
    state = block_states(ref_cnt, has_hash)
    owner = np.full(n, -1, np.int32)
    filled = np.where(has_hash, block_size, 0).astype(np.int16)
    cpu_state = np.zeros(num_cpu_blocks, np.uint8)
    cpu_owner = np.full(num_cpu_blocks, -1, np.int32)
    requests = sorted(requests, key=_index)
    _owners_and_fill(requests, block_size, owner, filled, reserved)
    group = _block_groups(n, requests, block_hashes, reserved) if num_groups > 1 else np.zeros(0, np.int8)
    if reserved:
        state[list(reserved)] = BlockState.RESERVED
    for r in requests:
        for c in r.cpu_block_ids:
            cpu_state[c] = BlockState.SWAPPED
            cpu_owner[c] = r.index
    for a in (state, ref_cnt, owner, has_hash, last_access, filled, free_queue, cpu_state, cpu_owner, group):
        a.flags.writeable = False  # a snapshot is shared between threads: nobody may mutate it
    return KVSnapshot(
        step=step,
        block_size=block_size,
        num_blocks=n,
        state=state,
        ref_cnt=ref_cnt,
        owner=owner,
        has_hash=has_hash,
        last_access=last_access,
        filled=filled,
        free_queue=free_queue,
        requests=tuple(requests),
        cached_tokens=cached_tokens,
        block_hashes=block_hashes,
        counters=counters,
        cpu_state=cpu_state,
        cpu_owner=cpu_owner,
        reserved=tuple(reserved),
        num_groups=num_groups,
        kv_groups=tuple(kv_groups),
        block_group=group,
        **extra,
    )


def block_states(ref_cnt: np.ndarray, has_hash: np.ndarray) -> np.ndarray:
    """Each block's ``BlockState`` from (ref count clipped to 2, hashed) through a table: one pass
    instead of three np.where."""
    code = np.minimum(ref_cnt, 2).astype(np.uint8)  # ref counts are never negative; clip's limit checks cost more
    code <<= 1
    code |= has_hash
    return _STATE_OF_CODE[code]


_STATE_OF_CODE = np.array(
    [BlockState.FREE, BlockState.CACHED, BlockState.USED, BlockState.USED, BlockState.SHARED, BlockState.SHARED],
    np.uint8,
)


def _owners_and_fill(
    requests: list[RequestInfo], block_size: int, owner: np.ndarray, filled: np.ndarray, reserved=()
) -> None:
    """Each block's earliest owner (``requests`` sorted by index) and its filled slots, in a few array
    operations over every request's table at once (a Python loop here cost ~80 ms at 65,536 blocks). With
    several KV cache groups, every group's table counts; a reserved block in a table (vLLM's null block, in
    place of a block a window gave back) is nobody's."""
    if any(r.group_block_ids for r in requests):
        rows = [(r, t) for r in requests for t in r.tables]
    else:
        rows = [(r, r.block_ids) for r in requests]
    lens = np.fromiter((len(t) for _, t in rows), np.int64, len(rows))
    total = int(lens.sum())
    if not total:
        return
    blocks = np.fromiter(chain.from_iterable(t for _, t in rows), np.int64, total)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    computed = np.repeat(np.fromiter((r.num_computed_tokens for r, _ in rows), np.int64, len(rows)), lens)
    fill = np.minimum(np.maximum(computed - (np.arange(total) - starts) * block_size, 0), block_size).astype(np.int16)
    index = np.repeat(np.fromiter((r.index for r, _ in rows), np.int32, len(rows)), lens)
    if reserved:
        keep = ~np.isin(blocks, np.asarray(reserved, np.int64))
        blocks, fill, index = blocks[keep], fill[keep], index[keep]
        if not len(blocks):
            return
    np.maximum.at(filled, blocks, fill)
    first = np.unique(blocks, return_index=True)[1]  # the first occurrence is the earliest request's
    owner[blocks[first]] = index[first]


def _block_groups(n: int, requests: list[RequestInfo], block_hashes: Mapping[int, str], reserved) -> np.ndarray:
    """Each block's KV cache group: the group whose table holds it, else the group its hash is keyed under."""
    group = np.full(n, NO_GROUP, np.int8)
    for b, key in block_hashes.items():
        if "/g" in key:
            group[b] = hash_group(key)
        else:
            group[b] = 0
    for r in requests:
        for g, t in enumerate(r.group_block_ids):
            if t:
                group[np.asarray(t, np.int64)] = g
    if reserved:
        group[list(reserved)] = NO_GROUP
    return group


def prompt_of(r) -> tuple[int, ...]:
    """A request's prompt as a tuple, made once (it never changes)."""
    prompt = r.prompt_tuple
    if prompt is None:
        prompt = r.prompt_tuple = tuple(r.prompt_token_ids)
    return prompt


def request_fields(r, block_ids: tuple[int, ...] | None, token_ids: tuple[int, ...]) -> tuple:
    """A live ``Request``'s ``RequestInfo`` fields in their order, with the block ids and tokens given
    (the wire passes deltas of them; ``request_info`` the whole)."""
    return (
        r.request_id,
        r.index,
        r.status._name_,
        len(r.prompt_token_ids),
        len(r.output_token_ids),
        max(r.num_cached_tokens, 0),
        r.num_computed_tokens,
        block_ids,
        r.output_text,
        token_ids,
        r.error,
        r.group_id,
        r.parent_id,
        tuple(r.cpu_block_ids),
        r.client,
    )


def request_info(r, block_ids: Sequence[int]) -> RequestInfo:
    """A row of the snapshot from a live ``Request``."""
    return RequestInfo(*request_fields(r, tuple(block_ids), prompt_of(r) + tuple(r.output_token_ids)))


@dataclass(frozen=True, slots=True)
class LiveRow:
    """A live request's row, not built: the request and the tables that hold its blocks, read as they are
    now. Only a ``LiveState`` holds these, read before the next step (the wire sends what changed straight
    from the request: building every row's whole token tuple each step, and then comparing it, was most
    of a record at 256 long requests). A request keeps its one ``LiveRow`` while it runs."""

    request: Request
    tables: KVCacheManager

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def block_ids(self) -> Sequence[int]:
        return self.tables.block_ids_view(self.request.request_id)


@dataclass(slots=True, eq=False)
class PoolState:
    """The raw pool and request state a ``KVSnapshot`` is derived from (``assembled``).

    It is what crosses the process boundary: the derived views (state, owner, filled, the CPU
    pool) cost ~0.2 ms of a small step and are built in the window's process, where they are drawn.
    Not frozen: its fields are never changed after it is made, but its assembled snapshot is made once,
    when first read (the window's views and its timeline read the same one).
    """

    step: int
    block_size: int
    ref_cnt: np.ndarray
    has_hash: np.ndarray
    last_access: np.ndarray
    free_queue: np.ndarray
    requests: tuple[RequestInfo, ...]  # sorted by index, as the snapshot has them
    cached_tokens: Mapping[int, tuple[int, ...]]
    block_hashes: Mapping[int, str]
    counters: dict[str, float]
    num_cpu_blocks: int
    block_bytes: int = 0
    model_name: str = ""
    counts: tuple[int, ...] | None = None  # blocks per state, when the engine counted them (the wire's)
    reserved: tuple[int, ...] = ()  # KVSnapshot's
    num_groups: int = 1
    pinned: dict[int, int] = field(default_factory=dict)
    kv_groups: tuple[KVCacheGroup, ...] = ()
    _snapshot: KVSnapshot | None = field(default=None, repr=False)  # assembled, once read

    @property
    def num_blocks(self) -> int:
        return len(self.ref_cnt)

    @property
    def state_counts(self) -> tuple[int, ...]:
        return self.counts if self.counts is not None else state_counts(self.ref_cnt, self.has_hash)

    has_arrays = True

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in RAW_ARRAYS}

    def cache_maps(self) -> tuple[dict[int, tuple[int, ...]], dict[int, str]]:
        return dict(self.cached_tokens), dict(self.block_hashes)

    def assembled(self) -> KVSnapshot:
        """The ``KVSnapshot`` of this state, made once."""
        if self._snapshot is None:
            self._snapshot = assemble_snapshot(
                self.step,
                self.block_size,
                self.ref_cnt,
                self.has_hash,
                self.last_access,
                self.free_queue,
                self.requests,
                self.cached_tokens,
                self.block_hashes,
                self.counters,
                self.num_cpu_blocks,
                self.reserved,
                self.num_groups,
                self.kv_groups,
                block_bytes=self.block_bytes,
                model_name=self.model_name,
                pinned=self.pinned,
            )
        return self._snapshot


@dataclass(frozen=True, slots=True)
class LiveState:
    """A live engine's state after a step (or a command), not copied: it reads the engine's own objects,
    so it is valid only until the engine changes again. An engine process reads it at once: the wire
    sends a step's rows as what changed and its blocks per state (counted by the pool as they change),
    and copies the pool's arrays only for the record it sends last (``arrays``), not for every step."""

    step: int
    block_size: int
    requests: tuple[RequestInfo | LiveRow, ...]  # sorted by index
    counters: dict[str, float]
    state_counts: tuple[int, ...]
    num_cpu_blocks: int
    block_bytes: int
    model_name: str
    ledger: PoolLedger  # the pool's record, kept as it changes
    reserved: tuple[int, ...] = ()  # kvscope's pool reserves no block (vLLM's null block is a probed vLLM's)
    num_groups: int = 1  # and has one KV cache group
    pinned: dict[int, int] = field(default_factory=dict)
    kv_groups: tuple[KVCacheGroup, ...] = ()

    @property
    def num_blocks(self) -> int:
        return self.ledger.num_blocks

    has_arrays = True  # the live ones: read them before the engine goes on

    def assembled(self) -> None:
        """Not drawable as it is: the wire makes a ``PoolState`` (or a digest) of it."""
        return None

    @property
    def unchanged(self) -> bool:
        """Whether the pool is still as it was (every change of a block is an event, drained into the
        record this state belongs to)."""
        return not self.ledger.events

    def arrays(self) -> dict[str, np.ndarray] | None:
        """The pool's per-block arrays (``PoolState``'s), not copied: read them before the engine goes on.
        None once the pool has changed since this state was read (a newer record will carry them)."""
        if not self.unchanged:
            return None
        p = self.ledger
        return {
            "ref_cnt": p.ref_cnt_arr,
            "has_hash": p.has_hash_arr,
            "last_access": p.last_access_arr,
            "free_queue": p.free_order.order(),
        }

    def cache_maps(self) -> tuple[dict[int, tuple[int, ...]], dict[int, str]]:
        """The prefix cache's token and hash maps, copied."""
        return dict(self.ledger.tokens_by_block.items()), dict(self.ledger.hash_hex_by_block.items())


@dataclass(frozen=True, slots=True)
class StepDigest:
    """What a record keeps when its snapshot will not be drawn (a newer one came with it): the rows,
    the counters and how many blocks are in each state, without the per-block arrays. The window's
    history needs no more of such a step, and the views draw only the newest snapshot."""

    step: int
    block_size: int
    num_blocks: int
    requests: tuple[RequestInfo, ...]
    counters: dict[str, float]
    state_counts: tuple[int, ...]  # blocks per BlockState, as np.bincount(snapshot.state) gives them
    num_cpu_blocks: int = 0
    block_bytes: int = 0
    model_name: str = ""

    has_arrays = False  # a digest: the rows and counts of a step the window did not draw

    def assembled(self) -> None:
        return None


RAW_ARRAYS = ("ref_cnt", "has_hash", "last_access", "free_queue")  # the per-block arrays a record carries


class PoolRecord(Protocol):
    """What every source of a block pool yields as a step's ``snapshot``, at one of four levels of detail:
    ``KVSnapshot`` (drawable), ``PoolState`` (raw arrays, assembled once when drawn), ``StepDigest`` (rows and
    counts, no arrays: a step the window did not draw) and ``LiveState`` (the engine's own objects, read by
    an engine process before its next step). Readers ask these, never which class they hold."""

    step: int
    block_size: int
    requests: tuple
    counters: dict[str, float]
    num_cpu_blocks: int
    block_bytes: int
    model_name: str
    has_arrays: bool  # whether it carries the per-block arrays (a keyframe can come from it)

    @property
    def num_blocks(self) -> int: ...

    @property
    def state_counts(self) -> tuple[int, ...]:
        """Blocks per ``BlockState``, as ``np.bincount`` over the assembled snapshot's state gives them."""
        ...

    def assembled(self) -> KVSnapshot | None:
        """The snapshot the views draw (made once), or None when it has no arrays to draw."""
        ...


def state_counts(ref_cnt: np.ndarray, has_hash: np.ndarray) -> tuple[int, ...]:
    """Blocks per ``BlockState`` of the device pool from the raw arrays, by the rule the snapshot's
    state uses."""
    return _counts(block_states(ref_cnt, has_hash))


def _counts(state: np.ndarray) -> tuple[int, ...]:
    return tuple(int(c) for c in np.bincount(state, minlength=len(BlockState)))


def pool_state(
    step: int,
    block_size: int,
    pool: PoolLedger,
    requests: list[RequestInfo],
    counters: dict,
    num_cpu_blocks: int,
    block_bytes: int = 0,
    model_name: str = "",
) -> PoolState:
    """The raw state of a live pool from its ledger, copied (the replay rebuilds the same from its event stream)."""
    for a in (
        ref_cnt := pool.ref_cnt_arr.copy(),
        has_hash := pool.has_hash_arr.copy(),
        last_access := pool.last_access_arr.copy(),
        free_queue := pool.free_order.order(),
    ):
        a.flags.writeable = False
    return PoolState(
        step,
        block_size,
        ref_cnt,
        has_hash,
        last_access,
        free_queue,
        tuple(sorted(requests, key=_index)),
        pool.tokens_by_block.freeze(),
        pool.hash_hex_by_block.freeze(),
        counters,
        num_cpu_blocks,
        block_bytes,
        model_name,
    )


def _index(r: RequestInfo) -> int:
    return r.index
