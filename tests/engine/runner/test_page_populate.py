"""The CPU pool's pages are made resident ahead of the blocks a step writes (engine/runner/page_populate.py): what
the thread populates is resident (the kernel's ``mincore`` says so), what lies past it stays lazy, no byte changes,
and a kernel that refuses the call leaves the pool lazy and the engine serving."""

from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner import page_populate
from engine.runner.page_populate import PagePopulator

PAGE = mmap.PAGESIZE
ROOT = Path(__file__).resolve().parents[3]


def resident(t: torch.Tensor, lo: int, hi: int, num_blocks: int) -> list[bool]:
    """Whether each page of blocks [lo, hi) of ``t`` is resident (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    per_block = t.numel() // num_blocks * t.element_size()
    start = t.data_ptr() + lo * per_block
    first = start & ~(PAGE - 1)
    length = t.data_ptr() + hi * per_block - first
    pages = (length + PAGE - 1) // PAGE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(first, length, vec) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vec.raw]


BLOCK = 2 * PAGE  # bytes a block


def pool(num_blocks: int) -> torch.Tensor:
    """A tensor over an anonymous mapping of its own: lazy for certain (a calloc may reuse pages that are resident)
    and in base pages (no huge page brings a whole 2 MiB region in at once, whatever the host's THP setting), so
    residency is exact."""
    buf = mmap.mmap(-1, num_blocks * BLOCK)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.float32).view(num_blocks, BLOCK // 4)


def test_the_blocks_ahead_are_made_resident_and_the_rest_stays_lazy():
    n = 4096
    t = pool(n)
    assert not any(resident(t, 0, n, n))
    t[3] = 7.0  # written by "the engine" before the thread gets there: kept
    p = PagePopulator([t], n, ahead=16)
    assert p.wait() and not p.failed
    assert p.upto == 16 and all(resident(t, 0, 16, n))
    assert not any(resident(t, 16, n, n))  # past the first chunk: untouched
    p.note(1000)  # a step wrote block 1000: 16 past it and a chunk more
    assert p.wait() and p.upto == 1001 + 32 and all(resident(t, 0, p.upto, n))
    assert not any(resident(t, p.upto, n, n))
    p.note(n - 1)
    assert p.wait() and p.done and p.upto == n and all(resident(t, 0, n, n))
    # no byte changed (read last: a read maps the zero page, which mincore counts as resident)
    assert torch.all(t[3] == 7.0) and torch.count_nonzero(t) == t.shape[1]


def refusing():
    """A libc madvise as a kernel before 5.14 answers MADV_POPULATE_WRITE."""

    def madvise(addr, length, advice):
        ctypes.set_errno(22)  # EINVAL
        return -1

    return madvise


def test_a_kernel_that_refuses_leaves_the_pool_lazy(monkeypatch):
    monkeypatch.setattr(page_populate, "_madvise", refusing)
    n = 64
    t = pool(n)
    p = PagePopulator([t], n, ahead=8)
    assert p.wait() and p.failed == "madvise(MADV_POPULATE_WRITE): errno 22" and p.done
    assert not any(resident(t, 0, n, n))
    p.note(10)  # asked again: nothing more is tried
    assert p.wait() and p.upto == 0


@pytest.mark.parametrize("refused", [False, True], ids=["populated", "kernel refuses"])
def test_the_blocks_a_step_writes_and_those_ahead_are_resident_and_the_tokens_do_not_change(
    tiny_hf, tiny_tokenizer, monkeypatch, refused
):
    """By the end of each step, its blocks and ``ahead`` more are resident (asked before its forward, populated
    beside it); where the kernel refuses, the engine serves as before. The same tokens either way."""
    if refused:
        monkeypatch.setattr(page_populate, "_madvise", refusing)
    engine = LLMEngine.from_hf_model(
        tiny_hf, tiny_tokenizer, num_gpu_blocks=256, block_size=4, max_num_seqs=2, max_num_batched_tokens=8
    )
    runner = engine.runner
    p = runner.populator
    assert p is not None and p.ahead == 8 // 4 + 2
    written: list[int] = []
    execute = runner.execute

    def checked(sched):
        top = max((s.block_ids[-1] for s in sched.scheduled if s.block_ids), default=-1)
        out = execute(sched)
        if not refused:
            p.wait()
            assert p.upto > top  # the step's blocks and those ahead of it: resident
            k = runner.kv_caches[0][0]
            assert all(resident(k, 0, top + 1, runner.num_blocks))
        written.append(top)
        return out

    monkeypatch.setattr(runner, "execute", checked)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11] for i in range(6)]
    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert max(written) > 2 * p.ahead  # the run went past the first chunks
    assert (p.failed is not None) == refused
    if refused:
        assert p.upto == 0 and p.failed.startswith("madvise") and runner.populator is None  # given up at once
    fresh = LLMEngine.from_hf_model(tiny_hf, tiny_tokenizer, num_gpu_blocks=256, block_size=4)
    fresh.runner.populator = None  # pages left lazy, as before
    again = LLM.from_engine(fresh).generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]


def test_at_exit_the_thread_ends_its_chunk_and_is_waited_for(tmp_path):
    """A script that builds a pool and exits at once: the exit hook (``stop_all``) waits for the populating thread,
    which ends after the chunk it is in. Left to Python's finalization, a daemon thread still inside ``madvise`` is
    ended by ``pthread_exit`` as it takes the GIL back, which aborted a process now and then (exit -6). Here the
    chunk is a slow stand-in ``madvise`` that writes a file when it returns, and the script exits once the thread is
    inside it: the file is there once the process has exited, and the exit status is 0. (A thread stopped before it
    began its chunk does none: that is not waited for, nor needed.)"""
    done = tmp_path / "chunk-done"
    script = f"""
import threading, time, torch
from engine.runner import page_populate
inside = threading.Event()
def slow(addr, length, advice):
    inside.set()
    time.sleep(0.5)
    open({str(done)!r}, "w").close()
    return 0
page_populate._madvise = lambda: slow
p = page_populate.PagePopulator([torch.zeros(64, 1024)], 64, ahead=8)
assert inside.wait(60)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert done.exists()


def test_at_exit_a_thread_freeing_its_populator_is_joined(tmp_path):
    """The abort of two core dumps, made certain. The engine gone, the populating thread held the pool's last
    reference and freed it as it ended; freeing a numpy-backed tensor gives the GIL up and takes it back, and a
    thread that takes it back once Python is finalizing is ended by ``pthread_exit``, which aborts through PyTorch's
    C++. The populator, half freed, was out of the exit hook's set by then. Here the freeing is an object of the
    populator's whose ``__del__`` gives the GIL up for 1 s and then writes a file, and the script exits while the
    thread is inside it: the exit hook joins the thread itself, so the file is there and the exit status is 0.
    (Waiting for the populators only, Python finalized during that second and the file was never written.)"""
    freed = tmp_path / "freed"
    script = f"""
import threading, time, torch
from engine.runner import page_populate
freeing = threading.Event()
class Freed:
    def __del__(self):
        freeing.set()
        time.sleep(1.0)
        open({str(freed)!r}, "w").close()
def slow(addr, length, advice):
    time.sleep(0.2)
    return 0
page_populate._madvise = lambda: slow
p = page_populate.PagePopulator([torch.zeros(64, 1024)], 64, ahead=8)
p.freed = Freed()
del p  # the thread holds the populator's last reference
assert freeing.wait(60) and threading.current_thread() is threading.main_thread()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert freed.exists()


def test_stop_returns_once_the_thread_has_ended(monkeypatch):
    monkeypatch.setattr(page_populate, "_madvise", lambda: lambda addr, length, advice: time.sleep(0.2) or 0)
    n = 64
    p = PagePopulator([pool(n)], n, ahead=8)
    thread = p._thread
    assert thread is not None and thread.is_alive()
    p.stop()
    assert not thread.is_alive() and not p._running


def test_a_stopped_populator_starts_no_thread(monkeypatch):
    monkeypatch.setattr(page_populate, "_madvise", lambda: lambda addr, length, advice: 0)
    n = 64
    p = PagePopulator([pool(n)], n, ahead=8)
    p.stop()  # what the exit hook does to each (stop_all, not called here: it would stop this process's other pools)
    assert not p._running
    p.note(40)
    assert not p._running and p.upto <= 8  # asked for more after the exit hook: nothing started
