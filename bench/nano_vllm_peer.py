"""nano-vllm's scheduler and block manager on the same fake-model workload, for a side-by-side figure.

nano-vllm (github.com/GeeeekExplorer/nano-vllm, ~1,200 lines of Python) is not on PyPI, and its
code is not part of this project. Get it yourself and point the benchmark at the checkout:

    git clone https://github.com/GeeeekExplorer/nano-vllm /tmp/nano-vllm && pip install xxhash
    python bench/scheduler_overhead.py --nano-vllm /tmp/nano-vllm

Only ``nanovllm/engine/{scheduler,block_manager,sequence}.py`` and ``sampling_params.py`` are
loaded, under stub packages, so its model code (flash-attn, CUDA) is never imported.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path


def load(path: str | Path):
    """(Scheduler, Sequence, SamplingParams) from a nano-vllm checkout."""
    root = Path(path) / "nanovllm"
    if not (root / "engine" / "scheduler.py").is_file():
        raise FileNotFoundError(f"{path} is not a nano-vllm checkout (no nanovllm/engine/scheduler.py)")
    for pkg in ("nanovllm", "nanovllm.engine"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(root / pkg.partition(".")[2].replace(".", "/"))] if "." in pkg else [str(root)]
        sys.modules[pkg] = mod
    config = types.ModuleType("nanovllm.config")
    config.Config = object  # only a type annotation in the scheduler: the real one loads a hub config
    sys.modules["nanovllm.config"] = config

    def module(name: str, file: Path):
        spec = importlib.util.spec_from_file_location(name, file)
        m = importlib.util.module_from_spec(spec)
        sys.modules[name] = m
        spec.loader.exec_module(m)
        return m

    sp = module("nanovllm.sampling_params", root / "sampling_params.py")
    seq = module("nanovllm.engine.sequence", root / "engine" / "sequence.py")
    module("nanovllm.engine.block_manager", root / "engine" / "block_manager.py")
    sched = module("nanovllm.engine.scheduler", root / "engine" / "scheduler.py")
    return sched.Scheduler, seq.Sequence, sp.SamplingParams


def stepper(path: str | Path, prompts: list[list[int]], steps: int, block_size: int, num_blocks: int, vocab: int):
    """A function running one timed step of ``schedule()`` + ``postprocess()`` with every request
    decoding (the prompts' prefill already done); it returns the step's seconds."""
    Scheduler, Sequence, SamplingParams = load(path)
    Sequence.block_size = block_size
    cfg = types.SimpleNamespace(
        max_num_seqs=len(prompts),
        max_num_batched_tokens=max(2048, 400 * len(prompts)),
        eos=-1,
        kvcache_block_size=block_size,
        num_kvcache_blocks=num_blocks,
    )
    s = Scheduler(cfg)
    for p in prompts:
        s.add(Sequence(list(p), SamplingParams(temperature=1.0, max_tokens=steps + 8, ignore_eos=True)))

    def fake_tokens(seqs):  # the same rule as common.install_fake_runner
        return [(len(q) * 7919 + 1) % vocab for q in seqs]

    seqs, prefill = s.schedule()  # every prompt prefills in this step
    s.postprocess(seqs, fake_tokens(seqs), prefill)

    def step() -> float:
        t0 = time.perf_counter()
        seqs, prefill = s.schedule()
        s.postprocess(seqs, fake_tokens(seqs), prefill)
        dt = time.perf_counter() - t0
        assert not prefill and len(seqs) == len(prompts)
        return dt

    return step


def measure(
    path: str | Path, prompts: list[list[int]], steps: int, block_size: int, num_blocks: int, vocab: int
) -> dict:
    """Median µs per step of ``schedule()`` + ``postprocess()`` with every request decoding."""
    step = stepper(path, prompts, steps, block_size, num_blocks, vocab)
    return {"us_per_step": 1e6 * statistics.median(step() for _ in range(steps))}
