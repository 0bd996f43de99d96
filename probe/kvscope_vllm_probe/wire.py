"""The probe's wire: what vLLM's probe and kvscope say to each other, one schema for both ends.

One ZeroMQ endpoint carries everything. The probe binds a ROUTER socket at ``KVSCOPE_PROBE_ENDPOINT``; each
subscriber (a kvscope window, ``--headless``, a test) connects a DEALER and says ``Hello``. The probe answers
``Welcome`` and a ``Keyframe`` (the whole pool), then sends every step's changes (``Step``): the pool's own
operations in the order vLLM made them (ref counts, hashes, and the free queue's pops, removals, appends and
prepends, each attributed to the request vLLM was working for) and the rows of the requests that changed.
A subscriber sends ``Command``s (pause, step N, run: refused unless vLLM allows them, see ``security.py``), a
``Heartbeat`` every second (a peer silent for ``SILENT_S`` is gone, and so is any pause it held), ``Resync``
(a fresh keyframe, after a gap in ``seq``) and ``Bye``. Anything but ``Hello`` from a peer that has not said it
is refused. Each data-parallel rank has a probe of its own (``endpoints.py``); ``Welcome`` says which.

These are the same things kvscope's engine process sends its window (a keyframe of the pool's arrays, then
each step's events and request rows as deltas), in msgpack instead of pickle: the probe runs inside vLLM,
which has msgspec and pyzmq but not kvscope. ``PROTOCOL`` changes whenever a message changes shape; the two
ends refuse each other's in one line when it differs.
"""

from __future__ import annotations

from typing import Union

import msgspec

from .constants import (  # noqa: F401 - the wire's names, one import for both ends
    ENV_ANY_RELEASE,
    ENV_ENDPOINT,
    ENV_FAULT,
    FAULTS,
    HEARTBEAT_S,
    OP_APPEND,
    OP_HASH,
    OP_MAP_CLEAR,
    OP_MAP_INSERT,
    OP_MAP_POP,
    OP_POP,
    OP_PREPEND,
    OP_REF,
    OP_REMOVE,
    OP_REQUEST,
    PROTOCOL,
    SILENT_S,
)


class Message(msgspec.Struct, array_like=True, tag=True, omit_defaults=False):
    pass


# -- subscriber -> probe ---------------------------------------------------------------------------
class Hello(Message):
    protocol: int
    client: str  # who subscribes, for vLLM's log ("kvscope 0.1.0 window")


class Command(Message):
    op: str  # "pause" | "run" | "step"
    n: int = 1  # with "step": schedules to run before pausing again


class Heartbeat(Message):
    pass


class Resync(Message):
    pass


class Bye(Message):
    pass


class SetFault(Message):
    name: str  # one of FAULTS
    on: bool


# -- probe -> subscriber ---------------------------------------------------------------------------
class Welcome(Message):
    protocol: int
    probe_version: str
    vllm_version: str
    instance: str  # random per vLLM start: a subscriber tells a restart from a pause by it
    dp_rank: int = 0  # this engine core's data-parallel rank (its probe listens at endpoints.rank_endpoint)
    dp_size: int = 1  # how many data-parallel ranks vLLM runs, each with its own probe
    control: bool = False  # Pause, Step and Run are allowed (vLLM started with KVSCOPE_PROBE_CONTROL=1)
    remote_faults: bool = False  # SetFault is allowed (KVSCOPE_PROBE_REMOTE_FAULTS=1)


class Refused(Message):
    reason: str  # one line


class KVGroup(msgspec.Struct, array_like=True):
    """One KV cache group: vLLM gives every layer type of a hybrid model its own (all in one block pool)."""

    kind: str  # "full" | "sliding_window" | "chunked_local" | "mamba" | vLLM's manager class name for the rest
    block_size: int  # tokens a block of this group holds (a state group's: the tokens between two states)
    window: int = 0  # the sliding window or the local chunk, in tokens (0: none)
    layers: int = 0  # how many of the model's layers keep their KV (or state) in this group
    manager: str = ""  # vLLM's single-type manager class (FullAttentionManager, SlidingWindowManager, ...)
    mode: str = ""  # a mamba group's mamba_cache_mode ("align": a state a block boundary, prefix-cacheable)


class PoolInfo(msgspec.Struct, array_like=True):
    model: str
    vllm_version: str
    block_size: int
    num_blocks: int
    null_block: int  # vLLM's placeholder block (never freed, never in a table's count), -1 if none
    enable_caching: bool
    hash_algo: str
    num_kv_groups: int  # KV cache groups (a hybrid model has several, all in this one pool): ``groups``
    async_scheduling: bool  # stepping needs --no-async-scheduling (a step then runs ahead of the pause)
    max_model_len: int
    fault: str  # the fault switched on ("" for none)
    notes: list[str] = []  # what the probe could not follow in this vLLM, one line each
    block_bytes: int = 0  # a block's KV in bytes, every layer of every group (0: not known)
    dtype: str = ""  # the model's
    groups: list[KVGroup] = []  # every KV cache group, by its id (empty from a probe before protocol 2)
    connector: str = ""  # the KV connector's class ("" for none): what holds blocks for a transfer


class RequestRow(msgspec.Struct, array_like=True):
    request_id: str
    status: str  # vLLM's RequestStatus name: WAITING, RUNNING, PREEMPTED, FINISHED_STOPPED, ...
    num_prompt_tokens: int
    tokens_from: int  # the index of tokens[0] in the request's token ids (0: all of them)
    tokens: list[int]
    num_computed_tokens: int
    num_cached_tokens: int  # prefix-cache hit at its latest admission, in tokens (-1: not admitted yet)
    blocks_from: int  # the index of block_ids[0] in the table (0: the whole table)
    block_ids: list[int] | None  # KV cache group 0's table from blocks_from on; None: as sent before
    arrival: float  # vLLM's arrival time (time.time())
    # the other groups' tables that changed, as (group, blocks_from, block ids) (the null block where vLLM put it:
    # a sliding window's blocks that left the window, a state group's retired states)
    groups: list[tuple[int, int, list[int]]] = []
    # each group's own prefix-cache hit at the latest admission, in tokens (hybrid models: the hit is the shortest
    # of them, so the group with the shortest one is the group that missed); [] when not measured
    group_hits: list[int] = []


class Keyframe(Message):
    seq: int
    step: int
    info: PoolInfo
    ref_cnt: list[int]
    hashes: list[tuple[int, int, list[int]]]  # (block, hash64, token ids) for every hashed block
    hash_map: list[tuple[int, int]]  # (hash64, block) for every entry of vLLM's hash map
    free_queue: list[int]  # head (next to be handed out) first
    requests: list[RequestRow]
    deferred: list[list[int]]  # scheduler.deferred_frees: blocks out of a table, not yet freed (0.32+)
    paused: bool
    holder: str  # who holds the pause ("" when running)
    counters: dict[str, int | float]
    pinned: list[tuple[int, int]] = []  # (block, references) the connector holds with no table behind them
    hash_groups: list[int] = []  # the KV cache group of each of ``hashes`` (empty: all group 0)
    map_groups: list[int] = []  # the KV cache group of each of ``hash_map``'s keys (empty: all group 0)


class Step(Message):
    seq: int
    step: int  # vLLM schedules so far (update_from_output calls); a record between steps repeats it
    seconds: float  # the step's wall time, schedule() to the end of update_from_output()
    ops: list[list]
    rows: list[RequestRow]  # rows that changed
    gone: list[tuple[str, str]]  # (request id, final status): no longer in vLLM's scheduler
    deferred: list[list[int]] | None  # None: as before
    counters: dict[str, int | float]
    paused: bool
    between: bool = False  # changes between two steps (an abort, a new request): no schedule ran
    # running requests that only went on: (request id, tokens_from, new tokens, num_computed_tokens)
    advanced: list[tuple[str, int, list[int], int]] = []
    pinned: list[tuple[int, int]] | None = None  # the connector's references (Keyframe.pinned); None: as before
    # the tables of running requests that only grew: (request id, group, blocks_from, new block ids)
    grown: list[tuple[str, int, int, list[int]]] = []
    # table positions where vLLM put its null block this step (a sliding window's block that left the window, a
    # state group's retired state): (request id, group, positions), applied after ``rows`` and before ``grown``
    nulled: list[tuple[str, int, list[int]]] = []
    # the running requests when each decoded one token and nothing else changed for it (most steps of a decode
    # batch: no tuple a request), applied after ``advanced``: the batch's request ids in order (None: those of the
    # last Step that said them, since the last keyframe), the token each decoded and each one's computed count
    run_ids: list[str] | None = None
    run_tokens: list[int] = []
    run_computed: list[int] = []


class Held(Message):
    """The pause changed: vLLM is paused (at ``step``, by ``holder``) or running again."""

    paused: bool
    step: int
    holder: str
    reason: str = ""


class Pong(Message):
    pass


ToProbe = Union[Hello, Command, Heartbeat, Resync, Bye, SetFault]
FromProbe = Union[Welcome, Refused, Keyframe, Step, Held, Pong]

_encoder = msgspec.msgpack.Encoder()
_to_probe = msgspec.msgpack.Decoder(ToProbe)
_from_probe = msgspec.msgpack.Decoder(FromProbe)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_to_probe(data: bytes) -> ToProbe:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything that is not one of these messages."""
    return _to_probe.decode(data)


def decode_from_probe(data: bytes) -> FromProbe:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything that is not one of these messages."""
    return _from_probe.decode(data)


# Where the numbers are in vLLM's block keys, big-endian: a key is a request's block hash with its KV cache group's
# id appended in 4 bytes, and a block hash's low 64 bits are what vLLM's KV events carry (``maybe_convert_block_hash``).
# The probe sends a step's keys as vLLM made them, and the subscriber splits them with the functions below: vLLM's
# thread does no arithmetic for it.
KEY_HASH64 = slice(-12, -4)  # of a block key (hash + group id): the hash's low 64 bits
KEY_GROUP = slice(-4, None)  # of a block key: the KV cache group
REQUEST_HASH64 = slice(-8, None)  # of a request's block hash (no group id): its low 64 bits


def block_key(h64: int, group: int = 0) -> bytes:
    """A block key as vLLM makes one, from its low 64 bits and its group (tests, and recorded traces)."""
    return h64.to_bytes(8, "big") + group.to_bytes(4, "big")


def parent64(request_hash: bytes) -> int:
    """A request's block hash (no group id) as vLLM's KV events carry it: its low 64 bits."""
    return int.from_bytes(request_hash[REQUEST_HASH64], "big")


def group_of(block_hash: bytes) -> int:
    """The KV cache group a vLLM block key is for (its last 4 bytes)."""
    return int.from_bytes(block_hash[KEY_GROUP], "big")


def hash64(block_hash: bytes) -> int:
    """A vLLM block key's hash as its KV events carry it: the low 64 bits of the hash (the key's last 4 bytes
    are the KV cache group's id), as ``maybe_convert_block_hash`` reads them."""
    return int.from_bytes(block_hash[KEY_HASH64], "big")
