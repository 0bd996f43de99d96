"""What changed in vLLM's block pool, op by op, in the order vLLM did it: the probe's only hook into the pool.

Three kinds of hook, each chosen so that nothing can change unseen and the cost follows the changes, not
the pool's size (a full dump costs 54 ms at 65,536 blocks):
- ``KVCacheBlock``'s ``__setattr__`` records the writes of ``ref_cnt`` and ``_block_hash``. Every ref count and
  every hash vLLM writes passes through it, whoever writes it (the pool, a single-type manager's copy-on-write, a
  fault). Both are slots of a slotted dataclass in every release the probe knows (``compat.py``), so the slots'
  own member descriptors do the storing, and every read stays theirs (C, no Python frame).
- The free queue's mutators (``popleft``, ``popleft_n``, ``remove``, ``append``, ``append_n``, ``prepend_n``)
  are wrapped on this pool's queue instance: they say where in the queue a block went, which a ref count
  alone does not (vLLM puts an unhashed block at the head, a hashed one at the tail).
- The hash map's ``insert`` and ``pop`` (``BlockHashToBlockMap``, patched on the class: ``reset_prefix_cache``
  replaces the map with a new one) say what the map holds, so that the audit checks it against the blocks.
- The KV cache manager's request-taking methods are wrapped to say which request the ops are for, and
  ``BlockPool.cache_full_blocks`` to say which tokens a newly hashed block holds (vLLM keeps no tokens in a
  block; its KV events read them from the request, and so does this), for which KV cache group.
- A KV connector's scheduler-side methods (``scheduler.connector``) are wrapped so that the ref counts they
  change are named as the connector's: a pin (``touch`` with no table behind it) and its release. The recorder
  keeps what the connector holds (``pinned``), which the audit counts as it counts the tables.

Only the scheduler's own pool is recorded: a connector may build a second ``BlockPool`` of ``KVCacheBlock``s
(SimpleCPUOffload's CPU pool), whose blocks pass through the same class-wide hook; a block is recorded
only when it is the one at its id in this pool (``pool.blocks[id] is block``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from .constants import (
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
)
from .groups import describe

QUEUE_OPS = {
    "popleft": OP_POP,
    "popleft_n": OP_POP,
    "remove": OP_REMOVE,
    "append": OP_APPEND,
    "append_n": OP_APPEND,
    "prepend_n": OP_PREPEND,
}
# the KV cache manager's methods whose first argument is the request the pool's ops are done for. Not
# allocate_slots: it runs for every scheduled request every step (256 a decode step at GPU size), and a wrapper
# that forwards its keyword arguments cost ~0.7 us a call here, 0.18 ms a step. The blocks it hands out are
# named by the request whose table gained them (the subscriber reads that from the rows: kvscope's mirror).
REQUEST_METHODS = (
    "get_computed_blocks",
    "get_computed_blocks_for_connector",  # 0.32+: the lookup of a request scheduled with a KV connector
    "free",
    "cache_blocks",
    "pop_blocks_for_free",
)
LOOKUPS = ("get_computed_blocks", "get_computed_blocks_for_connector")
_block_id = attrgetter("block_id")
CONNECTOR = "connector:"  # the request name of the ops a KV connector makes (``connector:ExampleConnector``)

_active: Recorder | None = None  # one scheduler a process (vLLM's engine core); the class hooks route here
_installed = False


class Recorder:
    def __init__(self, scheduler, block_size: int) -> None:
        self.scheduler = scheduler
        self.manager = scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        self.blocks = self.pool.blocks  # a block is recorded only when it is this pool's (see _install_block_hooks)
        self.num_blocks = len(self.blocks)
        self.queue = self.pool.free_block_queue
        self.block_size = block_size
        self.hash_block_size = int(getattr(self.pool, "hash_block_size", 0) or block_size)
        self.coordinator = self.manager.coordinator
        self.groups = describe(scheduler)
        self.connector = getattr(scheduler, "connector", None)
        self.connector_name = type(self.connector).__name__ if self.connector is not None else ""
        self.pinned: dict[int, int] = {}  # block -> references the connector holds (its touch()es, not yet freed)
        self.pins_changed = False
        self.group_hits: dict[str, list[int]] = {}  # request id -> each group's own prefix hit (hybrid models)
        self.loose: set[int] = set()  # blocks freed with no request named since the last take (see take)
        self._looking_up = False
        self.ops: list[list] = []
        self.request = ""  # the request the current ops are for
        self._said_request = ""  # the request the last OP_REQUEST named
        self.touched: set[str] = set()  # requests the pool worked for since the last take (a ref count changed)
        self.cached_tokens: dict[str, int] = {}  # request id -> prefix-cache hit at its latest admission
        self.admissions: list[tuple[str, int, int]] = []  # (request id, tokens asked, tokens hit) since the last take
        self.tokens_of: dict[int, list[int]] = {}  # hashed block -> its tokens (for a keyframe)
        self.preemptions = 0  # frees of a request still running: vLLM preempts before it sets the status
        # during cache_full_blocks: [request, its group's table, the next index to look at, the group's block size]
        # (vLLM hashes a table's new full blocks in order: on_hash finds each from where the last one was)
        self._storing: list[Any] | None = None
        self.before_free: Callable[[object], None] | None = None  # a fault's hook (faults.py)
        self._saved: list[tuple[object, str, object]] = []

    # -- installing -------------------------------------------------------------------------------
    def install(self) -> None:
        global _active
        _install_block_hooks(type(self.pool.blocks[0]))
        _install_map_hooks(type(self.pool.cached_block_hash_to_block))
        self._wrap(self.pool, "reset_prefix_cache", self._reset(self.pool.reset_prefix_cache))
        for name, code in QUEUE_OPS.items():
            if hasattr(self.queue, name):
                self._wrap(self.queue, name, _queue_wrapper(self, getattr(self.queue, name), code))
        self._wrap(self.pool, "cache_full_blocks", self._cache_full_blocks(self.pool.cache_full_blocks))
        for name in REQUEST_METHODS:
            if hasattr(self.manager, name):
                self._wrap(self.manager, name, self._for_request(getattr(self.manager, name), name))
        if self.connector is not None:
            for name, fn in _connector_methods(self.connector):
                self._wrap(self.connector, name, self._for_connector(fn))
        _active = self

    def uninstall(self) -> None:
        """Put vLLM's own methods back (the class hooks stay, recording nothing)."""
        global _active
        for obj, name, _ in reversed(self._saved):
            try:
                delattr(obj, name)  # the instance attribute hid the class's method
            except AttributeError:
                pass
        self._saved.clear()
        if _active is self:
            _active = None

    def _wrap(self, obj, name: str, wrapper) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, wrapper)

    # -- wrappers ---------------------------------------------------------------------------------
    def begin(self) -> None:
        """A scheduler entry starts (schedule, update_from_output, ...): no request named yet."""
        self.request = ""

    def _for_request(self, fn, name: str):
        @functools.wraps(fn)
        def wrapper(request, *args, **kwargs):
            outer = self.request
            rid = self.request = request.request_id
            lookup = name in LOOKUPS and not self._looking_up  # the connector's lookup calls the plain one inside
            if lookup:
                self._looking_up = True
            try:
                if name == "free":
                    if request.status.name == "RUNNING":
                        self.preemptions += 1
                    elif self.before_free is not None:
                        self.before_free(request)
                result = fn(request, *args, **kwargs)
            finally:
                self.request = outer
                if lookup:
                    self._looking_up = False
            if lookup:
                hit = result[1]
                self.cached_tokens[rid] = hit
                self.admissions.append((rid, request.num_tokens, hit))
                self.touched.add(rid)
                if len(self.groups) > 1:
                    self.group_hits[rid] = self._group_hits(request)
            return result

        return wrapper

    def _group_hits(self, request) -> list[int]:
        """Each group's own prefix-cache hit for ``request``, in tokens, as vLLM's hybrid coordinator measures it
        before it takes the shortest (lookups only: nothing in the pool changes)."""
        per_group = getattr(self.coordinator, "find_longest_cache_hit_per_group", None)
        if per_group is None:
            return []
        try:
            return [int(n) for n in per_group(request.block_hashes, request.num_tokens - 1)[1]]
        except Exception:  # noqa: BLE001 - a lookup the probe adds must never fail vLLM's step
            return []

    def _for_connector(self, fn):
        """A connector method: the ref counts it changes are the connector's (its pins and their release)."""
        me = CONNECTOR + self.connector_name

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # a request the connector is told about may change with no ref count changing (a free it delays: the
            # request stays, finished, with its tables): its row is looked at whole
            rid = getattr(args[0], "request_id", None) if args else None
            if type(rid) is str:
                self.touched.add(rid)
            outer = self.request
            self.request = me
            try:
                return fn(*args, **kwargs)
            finally:
                self.request = outer

        return wrapper

    def _cache_full_blocks(self, fn):
        @functools.wraps(fn)
        def wrapper(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs):
            if num_full_blocks <= num_cached_blocks:  # nothing new to hash: every request, every step
                return fn(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
            bs = kwargs.get("block_size", args[0] if args else self.block_size)
            outer, outer_storing = self.request, self._storing
            self.request = request.request_id
            self._storing = [request, blocks, num_cached_blocks, bs]
            try:
                return fn(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
            finally:
                self.request, self._storing = outer, outer_storing

        return wrapper

    def _reset(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            ok = fn(*args, **kwargs)
            if ok:
                self.ops.append([OP_MAP_CLEAR])
            return ok

        return wrapper

    # -- what the hooks record ------------------------------------------------------------------------
    def _say_request(self) -> None:
        if self.request != self._said_request:
            self._said_request = self.request
            self.ops.append([OP_REQUEST, self.request])

    def on_ref(self, block, value: int, old: int) -> None:
        b = block.block_id
        request = self.request
        if request != self._said_request:
            self._say_request()
        if not request:
            if value < old:  # a table entry replaced by the null block (a window slid, a state retired), or a
                self.loose.add(b)  # deferred free: which table, if any, the rows look up (RowTracker.changed)
        elif request.startswith(CONNECTOR):
            n = self.pinned.get(b, 0) + value - old
            if n > 0:
                self.pinned[b] = n
            else:
                self.pinned.pop(b, None)
            self.pins_changed = True
        else:
            self.touched.add(request)  # its status may have changed: its row is looked at whole
        self.ops.append([OP_REF, b, value])

    def on_hash(self, block, value) -> None:
        """vLLM's key goes on the wire as vLLM made it (bytes: the hash, then the group), and so does the parent's
        hash: the subscriber splits them (``wire.hash64``, ``wire.group_of``), not vLLM's thread."""
        b = block.block_id
        if self.request != self._said_request:
            self._say_request()
        if value is None:
            self.tokens_of.pop(b, None)
            self.ops.append([OP_HASH, b, None, [], None])
            return
        tokens: list[int] = []
        parent = None
        storing = self._storing
        if storing is not None:
            request, table, i, bs = storing
            n = len(table)
            while i < n and table[i] is not block:  # the blocks vLLM skips (null, masked, hashed before)
                i += 1
            if i < n:
                storing[2] = i + 1
                # the request's own token list where vLLM keeps one (a slice of it is a new list; its read-only
                # all_token_ids view slices in Python)
                ids = getattr(request, "_all_token_ids", None)
                tokens = (
                    ids[i * bs : (i + 1) * bs]
                    if type(ids) is list
                    else list(request.all_token_ids[i * bs : (i + 1) * bs])
                )
                # the group's block hashes are the request's (made every hash_block_size tokens) at its block ends
                k = i * (bs // self.hash_block_size or 1) - 1
                if i > 0 and 0 <= k < len(request.block_hashes):
                    parent = request.block_hashes[k]
        self.tokens_of[b] = tokens
        self.ops.append([OP_HASH, b, value, tokens, parent])

    def on_map(self, code: int, key: bytes, block) -> None:
        if self.request != self._said_request:
            self._say_request()
        self.ops.append([code, key, block.block_id])

    def take(self) -> tuple[list[list], set[str], list[tuple[str, int, int]]]:
        """The ops, the requests the pool worked for and the admissions since the last take (``loose``, the
        blocks freed for no named request, is the rows' to clear: they look up whose table held them)."""
        ops, touched, adm = self.ops, self.touched, self.admissions
        self.ops, self.touched, self.admissions = [], set(), []
        self._said_request = ""
        touched.discard("")
        return ops, touched, adm

    def take_pins(self) -> list[tuple[int, int]] | None:
        """What the connector holds, if it changed since the last take (None: as before)."""
        if not self.pins_changed:
            return None
        self.pins_changed = False
        return sorted(self.pinned.items())


def _connector_methods(connector) -> list[tuple[str, Callable]]:
    """The connector's public methods (its class's functions), bound: the scheduler calls these."""
    out = []
    for name, _fn in inspect.getmembers(type(connector), inspect.isfunction):
        if not name.startswith("_"):
            out.append((name, getattr(connector, name)))
    return out


def _queue_wrapper(rec: Recorder, fn, code: int):
    """The free queue's mutator ``fn``, recording where its blocks went as one op (``code``). Inline and with no
    comprehension (each a Python frame): vLLM pops a block a request a group, 512 a step at GPU size on a hybrid
    pool."""
    if code == OP_POP:

        @functools.wraps(fn)
        def pop(*args, **kwargs):
            out = fn(*args, **kwargs)
            if rec.request != rec._said_request:
                rec._say_request()
            rec.ops.append([OP_POP, list(map(_block_id, out)) if isinstance(out, list) else [out.block_id]])
            return out

        return pop

    @functools.wraps(fn)
    def put(arg, *args, **kwargs):
        fn(arg, *args, **kwargs)
        if code == OP_REMOVE:
            ids: Any = arg.block_id
        elif isinstance(arg, list):
            if not arg:
                return
            ids = list(map(_block_id, arg))
        else:
            ids = [arg.block_id]  # append(block)
        if rec.request != rec._said_request:
            rec._say_request()
        rec.ops.append([code, ids])

    return put


_map_installed = False


def _install_map_hooks(cls) -> None:
    """Make ``cls.insert`` and ``cls.pop`` record changes to the active pool's hash map (once a process)."""
    global _map_installed
    if _map_installed:
        return
    insert, pop = cls.insert, cls.pop

    def recorded_insert(self, key, block):
        insert(self, key, block)
        rec = _active
        if rec is not None and self is rec.pool.cached_block_hash_to_block:
            rec.on_map(OP_MAP_INSERT, key, block)

    def recorded_pop(self, key, block_id):
        block = pop(self, key, block_id)
        rec = _active
        if block is not None and rec is not None and self is rec.pool.cached_block_hash_to_block:
            rec.on_map(OP_MAP_POP, key, block)
        return block

    cls.insert, cls.pop = recorded_insert, recorded_pop
    _map_installed = True


def _install_block_hooks(cls) -> None:
    """Make ``cls.ref_cnt`` and ``cls._block_hash`` record their changes (once a process)."""
    global _installed
    if _installed:
        return
    ref_slot, hash_slot = cls.__dict__["ref_cnt"], cls.__dict__["_block_hash"]
    ref_set, hash_set = ref_slot.__set__, hash_slot.__set__
    base_setattr = cls.__setattr__

    # Writes are caught by the class's __setattr__, not by properties over the slots: vLLM reads these far more
    # often than it writes them (a pool at 256 requests: 512 to 1,000 reads a step, a write a block handed out,
    # hashed or freed), and a property's read, even with the slot's own C getter, took 100 ns against the slot's
    # 12 (measured with timeit on vLLM 0.32's KVCacheBlock). The slots stay the class's own descriptors. It is one
    # Python frame with the two names tested inline (a dict of setters and a frame each cost 0.2 us more a
    # recorded write): every write to a block passes through it, the free queue's links too.
    def recorded_setattr(self, name, value):
        if name == "ref_cnt":
            rec = _active
            if rec is None:
                ref_set(self, value)
                return
            try:
                old = self.ref_cnt
            except AttributeError:  # __init__ setting it the first time
                ref_set(self, value)
                return
            ref_set(self, value)
            if value != old:
                b = self.block_id
                if 0 <= b < rec.num_blocks and rec.blocks[b] is self:  # the scheduler's pool, not a connector's
                    rec.on_ref(self, value, old)
        elif name == "_block_hash":
            rec = _active
            if rec is None:
                hash_set(self, value)
                return
            try:
                old = self._block_hash
            except AttributeError:
                hash_set(self, value)
                return
            hash_set(self, value)
            if value != old:
                b = self.block_id
                if 0 <= b < rec.num_blocks and rec.blocks[b] is self:
                    rec.on_hash(self, value)
        else:
            base_setattr(self, name, value)  # the free queue's links and the rest: as vLLM wrote them

    cls.__setattr__ = recorded_setattr
    _installed = True
