"""The compiled block hook (``_blockhook.c``, which ``hook_build.compiled_hook`` finds) keeps the Python hook's rule
on a slotted class like vLLM's ``KVCacheBlock``: a changed ``ref_cnt`` or ``_block_hash`` calls back once, with the
value (and the old ref count); an unchanged one, a first set in ``__init__``, and every other attribute (the free
queue's links) are stored as the class stores them and call nothing; a callback's error reaches the writer; and
uninstall gives the class its own writes back.

Each case runs in a child process: the hook is installed on one class a process, for the process's life."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvscope_vllm_probe.hook_build import ENV_PURE_PYTHON, compiled_hook

if compiled_hook() is None:
    if os.environ.get("KVSCOPE_REQUIRE_COMPILER") == "1":  # CI builds it: a fail, not a skip
        raise AssertionError("the probe's compiled block hook was not built (pip install -e ./probe needs a compiler)")
    pytest.skip("the probe's compiled block hook is not built here (no C compiler)", allow_module_level=True)

BLOCK = """
from dataclasses import dataclass
from kvscope_vllm_probe.hook_build import compiled_hook

@dataclass(slots=True)
class Block:  # vLLM's KVCacheBlock's shape: the recorded slots and the links
    block_id: int
    ref_cnt: int = 0
    _block_hash: object = None
    prev_free_block: object = None
    next_free_block: object = None

hook = compiled_hook()
calls = []
"""


def run(body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    code = BLOCK + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


def test_a_changed_ref_count_or_hash_calls_back_once_and_nothing_else_does():
    proc = run(
        """
        hook.install(Block)
        hook.set_callbacks(lambda b, v, old: calls.append(("ref", b.block_id, v, old)),
                           lambda b, v: calls.append(("hash", b.block_id, v)))
        a, b = Block(1), Block(2)  # __init__'s first sets: nothing to record
        assert calls == [], calls
        a.ref_cnt = 1
        a.ref_cnt = 1  # unchanged
        a.ref_cnt += 1
        a._block_hash = b"k" * 8
        a._block_hash = b"k" * 8  # equal bytes: unchanged
        setattr(a, "".join(["ref", "_cnt"]), 5)  # a name that is not interned: the same rule
        a._block_hash = None
        a.prev_free_block, a.next_free_block = b, None  # the links: stored, nothing recorded
        assert a.prev_free_block is b and a.ref_cnt == 5 and a._block_hash is None
        want = [("ref", 1, 1, 0), ("ref", 1, 2, 1), ("hash", 1, b"k" * 8), ("ref", 1, 5, 2), ("hash", 1, None)]
        assert calls == want, calls
        assert hook.installed(Block)
        hook.set_callbacks(None, None)  # no recorder: stored, nothing called
        a.ref_cnt = 0
        assert a.ref_cnt == 0 and len(calls) == 5
        hook.uninstall(Block)
        assert not hook.installed(Block)
        hook.set_callbacks(lambda *x: calls.append(x), None)
        a.ref_cnt = 3  # the class's own writes again
        assert a.ref_cnt == 3 and len(calls) == 5
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_callbacks_error_reaches_the_writer_with_the_value_stored():
    proc = run(
        """
        hook.install(Block)
        def boom(b, v, old):
            raise RuntimeError("recorder failed")
        hook.set_callbacks(boom, None)
        a = Block(1)
        try:
            a.ref_cnt = 1
        except RuntimeError as e:
            assert str(e) == "recorder failed"
        else:
            raise AssertionError("the error was swallowed")
        assert a.ref_cnt == 1  # vLLM's write happened before the recorder was told, as in the Python hook
        try:
            hook.install(dict)
        except RuntimeError as e:
            print("one class:", e)
        try:
            hook.set_callbacks(1, None)
        except TypeError as e:
            print("not callable:", e)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "one class: the block hook is installed on another class" in proc.stdout
    assert "not callable: a callback must be callable or None" in proc.stdout


def test_the_python_hook_is_chosen_by_the_environment():
    proc = run("print(hook)", env={ENV_PURE_PYTHON: "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
