"""The CPU pool's pages made resident ahead of the blocks the engine hands out, on a thread of their own.

A CPU pool is allocated lazily (``memory.zeros``: calloc'd pages, mapped on first write), so that a 2 GiB pool costs
nothing until used. But the first write into a page is a page fault, and numpy asks for transparent huge pages on
an allocation this large: with the kernel's THP ``defrag`` at ``madvise`` (Debian's default), the first write into
each 2 MiB region zeroes it and may compact memory first. Measured in a step of six cached prompts and two decodes
(SmolLM2-135M, block 32, one thread): about five of the step's 30 ``rope_and_store`` calls took ~2.5 ms instead of
~25 us, ~12 ms of a 330 ms step, on every step that wrote into blocks never written before, and the free queue
hands out every never-used block before it reuses one. vLLM's CPU pool is zero-filled when it is allocated (its
start-up pays for every page at once).

Here ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) maps the pages of the next blocks in every layer's tensors from
a thread: ctypes releases the GIL for the call, the engine's thread goes on (on a spare core; with intra-op threads
on every core it takes CPU from them), and the call changes no byte, so a block the engine writes meanwhile keeps
what it wrote. The populated range stays within about two chunks of ``ahead`` blocks past the highest block id a
step has written (the free queue hands blocks out in id order until it first reuses one; one chunk is populated
when the engine is built), so a pool is made resident only as far as it is used. Where the kernel refuses the
call, pages stay lazy, as before. The CPU swap pool is not populated.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import mmap
import threading
import weakref

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+)
JOIN_S = 30.0  # the longest a stop waits: one chunk's madvise, a fraction of a second even for a large pool
PAGE = mmap.PAGESIZE  # 4 KiB on x86; 16 or 64 KiB on some arm64 and ppc64le kernels


@functools.cache
def _madvise():
    """libc's madvise, loaded once a process (None where the C library has none)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_live: weakref.WeakSet[PagePopulator] = weakref.WeakSet()  # for the exit hook (an engine dropped drops its own)


_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # every populating thread not yet ended


@atexit.register
def stop_all() -> None:
    """At exit, before Python finalizes: every populator stops after its chunk, and every populating thread is
    joined. A thread that takes the GIL back once Python is finalizing is ended by ``pthread_exit``, whose forced
    unwinding through PyTorch's C++ aborts the process ("terminate called without an active exception", exit -6,
    about 1 run in 40 of a script that built an engine and exited at once, on a loaded machine). Two core dumps
    showed how: the engine gone, the thread held the pool's last reference and freed it as it ended; freeing a
    numpy-backed tensor gives the GIL up and takes it back (``THPVariable_clear``, the storage's deleter). While it
    had the GIL given up, the populator was already half freed, out of ``_live`` (its weak references are
    cleared first), so waiting for the populators missed it. So the threads are joined themselves, their teardown
    included."""
    for p in list(_live):
        p.stop()
    for t in list(_threads):
        if t is not threading.current_thread():
            t.join(JOIN_S)


class PagePopulator:
    """Keeps every tensor's first ``upto`` blocks resident, ``upto`` running ``ahead`` blocks past ``note``'s.

    A thread runs only while there is a range to populate, and then ends: an engine dropped takes its pool with it.
    """

    def __init__(self, tensors: list[torch.Tensor], num_blocks: int, ahead: int) -> None:
        # the tensors a block indexes, each block a stride of the first dimension
        self.tensors = [
            t for t in tensors if t.device.type == "cpu" and t.dim() and t.shape[0] == num_blocks and t.is_contiguous()
        ]
        self.num_blocks, self.ahead = num_blocks, max(1, ahead)
        self.upto = 0  # blocks [0, upto) are resident in every tensor
        self.target = 0  # what the thread is asked to reach
        self.failed: str | None = None  # why the kernel refused (the pool stays lazy)
        self._lock = threading.Condition()
        self._running = False
        self._stopped = False  # at exit (stop): no thread starts again
        self._thread: threading.Thread | None = None  # the one running or last run (stop joins it)
        self._madvise = _madvise()
        if self._madvise is None:
            self.failed = "no madvise in this C library"
            return
        if not self.tensors or num_blocks <= 0:
            self.failed = "nothing to populate"
            return
        _live.add(self)
        self._ask(self.ahead)  # the first step's blocks

    @property
    def done(self) -> bool:
        """Nothing more to ask: every block asked for (a thread may still be populating the last chunk), or the
        kernel refused."""
        return self.failed is not None or self.target >= self.num_blocks

    def note(self, block_id: int) -> None:
        """A step writes into blocks up to ``block_id``: keep ``ahead`` blocks past it resident (asked a chunk of
        ``ahead`` further, so that a thread starts once every ``ahead`` blocks, not every step)."""
        need = block_id + 1 + self.ahead
        if need > self.target and self.failed is None:
            self._ask(need + self.ahead)

    def _ask(self, target: int) -> None:
        with self._lock:
            self.target = min(self.num_blocks, max(self.target, target))
            if not self._running and not self._stopped:
                self._running = True
                self._thread = threading.Thread(target=self._run, name="kv-page-populate", daemon=True)
                _threads.add(self._thread)
                self._thread.start()

    def wait(self, timeout: float = 30.0) -> bool:
        """Until the thread has reached its target or stopped (tests)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._running, timeout)

    def stop(self, timeout: float = JOIN_S) -> None:
        """The thread stops after the chunk it is populating and is joined, its teardown included (it may free the
        pool, see ``stop_all``); none starts again. The wait is one chunk's ``madvise`` at most."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self.upto >= self.target or self.failed is not None or self._stopped:
                    self._running = False
                    self._lock.notify_all()
                    return
                lo, hi = self.upto, self.target
            try:
                error = self._populate(lo, hi)
            except Exception as e:  # noqa: BLE001 - ctypes' own errors: the pool stays lazy, the flag is cleared
                error = f"{type(e).__name__}: {e}"
            with self._lock:
                if error is None:
                    self.upto = hi
                else:
                    self.failed = error
                    logger.debug("the KV pool's pages stay lazy: %s", error)

    def _populate(self, lo: int, hi: int) -> str | None:
        assert self._madvise is not None
        for t in self.tensors:
            per_block = t.stride(0) * t.element_size()
            first = (t.data_ptr() + lo * per_block) & ~(PAGE - 1)
            end = t.data_ptr() + hi * per_block
            if self._madvise(first, end - first, MADV_POPULATE_WRITE) != 0:
                return f"madvise(MADV_POPULATE_WRITE): errno {ctypes.get_errno()}"
        return None
