"""Section inspector: the engine process on CUDA, its shared memory, and a reader that consumes every batch.

A checkpoint folder of random Llama-2-7B weights (fp16, SmolLM2's tokenizer and vocabulary) is loaded
twice: in this process, where the engine steps bare, then in a spawned engine process (what ``kvscope``
runs), stepping at full speed while this process reads every batch as the window's reader does (decoded,
the last step of each kept whole with its arrays copied out of shared memory, the slot released). The same
64 requests (256 prompt tokens, 256 new) in both: steps a second attached over bare. Also the record's own
cost a step (the live state read, added to the batch, a due batch's arrays copied into shared memory and
pickled), measured in this process beside the step's time.
"""

from __future__ import annotations

import gc
import pickle
import threading
import time
from pathlib import Path

import torch

from .shared import Ctx, Section, Table, make_folder, scratch_folder, sync

FOLDER = scratch_folder("kvscope-gpucheck-7b")


def workload(vocab: int, n: int, prompt: int, new: int):
    from engine import SamplingParams

    g = torch.Generator().manual_seed(17)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [(torch.randint(1, vocab, (prompt,), generator=g).tolist(), params) for _ in range(n)]


def bare_and_record_cost(config, reqs, dev) -> dict:
    """The engine bare in this process, then the same requests with the engine process's record work timed."""
    from engine import LLMEngine
    from kvscope.runtime import protocol as p
    from kvscope.runtime.shm import ShmSlots
    from kvscope.runtime.wire import RecordEncoder
    from kvscope.sources.base import StepRecord
    from kvscope.sysinfo import MemoryReading

    engine = LLMEngine(config)
    out = {"num_blocks": engine.pool.num_blocks}
    for what in ("bare", "recorded"):
        for prompt, params in reqs:
            engine.add_request(prompt, params)
        slots = ShmSlots.create(engine.pool.num_blocks) if what == "recorded" else None
        enc = RecordEncoder()
        if slots is not None:
            enc.attach(slots)
        steps, record_s = 0, 0.0
        sync(dev)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            res = engine.step()
            steps += 1
            if slots is not None:
                t1 = time.perf_counter()
                enc.add(
                    p.Stepped(
                        StepRecord(engine.step_count, engine.live_state(), list(res.events), res, 0.0), MemoryReading()
                    )
                )
                if enc.due:
                    batch = enc.flush()
                    pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
                    enc.release(batch.slot)
                record_s += time.perf_counter() - t1
        sync(dev)
        seconds = time.perf_counter() - t0
        out[what] = {"steps": steps, "seconds": seconds, "record_ms": record_s * 1e3 / steps}
        if slots is not None:
            enc.flush()
            enc.detach()
            slots.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    return out


class Reader:
    """The window's reader without the window: every batch decoded, slots released, steps counted."""

    def __init__(self, conn) -> None:
        from kvscope.runtime.wire import RecordDecoder

        self.conn = conn
        self.decoder = RecordDecoder()
        self.slots = None
        self.info = None
        self.steps = 0
        self.running = None
        self.loaded = threading.Event()
        self.idle = threading.Event()
        self.errors: list[str] = []
        self.whole = 0
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self) -> None:
        from kvscope.runtime import protocol as p
        from kvscope.runtime.engine_process import AttachSlots, Heartbeat, ReleaseSlot
        from kvscope.runtime.shm import ShmSlots
        from kvscope.runtime.wire import WireBatch

        pending = None
        while True:
            try:
                if pending is not None and not self.conn.poll(0):
                    self.handle(pending, True, ReleaseSlot)
                    pending = None
                    continue
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, WireBatch):
                if pending is not None:
                    self.handle(pending, False, ReleaseSlot)
                pending = msg
                continue
            if pending is not None:
                self.handle(pending, True, ReleaseSlot)
                pending = None
            if isinstance(msg, p.Loaded):
                self.info = msg.info
                self.slots = ShmSlots.create(msg.info.num_blocks)
                self.decoder.slots = self.slots
                self.conn.send(AttachSlots(self.slots.spec))
                self.loaded.set()
            elif isinstance(msg, p.LoadFailed):
                self.errors.append(msg.message)
                self.loaded.set()
            elif isinstance(msg, p.RunningChanged):
                self.running = msg.running
                if not msg.running:
                    self.idle.set()
            elif isinstance(msg, p.Error):
                self.errors.append(msg.message)

    def handle(self, batch, newest: bool, release) -> None:
        whole = batch.has_arrays and newest
        results = self.decoder.decode(batch, whole)
        self.whole += whole
        self.steps += sum(1 for r in results if getattr(r, "record", None) is not None)
        if batch.slot is not None:
            self.conn.send(release(batch.slot))


def attached(config, reqs, timeout_s: float) -> dict:
    import logging

    from kvscope.runtime import protocol as p
    from kvscope.runtime.build import SourceSpec
    from kvscope.runtime.engine_process import spawn_engine
    from kvscope.sources.base import InjectSpec

    spawned = spawn_engine(SourceSpec(config), logging.WARNING, load=p.Load(None))
    reader = Reader(spawned.conn)
    try:
        if not reader.loaded.wait(timeout_s) or reader.errors:
            raise RuntimeError(f"the engine process did not load: {reader.errors or 'timeout'}")
        for prompt, params in reqs:
            spawned.conn.send(p.Inject(InjectSpec(prompt, params)))
        time.sleep(0.5)  # the injections are read before Run (the pipe keeps their order anyway)
        first = reader.steps
        reader.idle.clear()
        t0 = time.perf_counter()
        spawned.conn.send(p.Run())
        if not reader.idle.wait(timeout_s):
            raise RuntimeError("the engine process did not finish the requests in time")
        seconds = time.perf_counter() - t0
        time.sleep(0.2)
        return {
            "steps": reader.steps - first,
            "seconds": seconds,
            "whole": reader.whole,
            "errors": reader.errors,
            "num_blocks": reader.info.num_blocks,
            "device": reader.info.device,
        }
    finally:
        try:
            spawned.conn.send(p.Shutdown())
        except OSError:
            pass
        spawned.proc.join(30)
        if spawned.proc.is_alive():
            spawned.proc.kill()
        if reader.slots is not None:
            reader.slots.close()


def run(ctx: Ctx, section: Section) -> None:
    from engine import EngineConfig

    dev = ctx.device
    folder = make_folder(ctx.big, ctx.dtype, dev, FOLDER if not ctx.dry_run else Path("/tmp/kvscope-gpucheck-tiny"))
    n, prompt, new = ctx.n(64, 4), ctx.n(256, 16), ctx.n(256, 16)
    config = EngineConfig(
        model=str(folder),
        device=str(dev),
        max_num_seqs=n,
        max_model_len=ctx.n(2048, 256),
        block_size=16,
        **({"num_gpu_blocks": 256} if ctx.dry_run else {}),
    )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(folder)).vocab_size
    reqs = workload(vocab, n, prompt, new)
    bare = bare_and_record_cost(config, reqs, dev)
    att = attached(config, reqs, max(60.0, ctx.left_s() - 10))
    b_rate = bare["bare"]["steps"] / bare["bare"]["seconds"]
    a_rate = att["steps"] / att["seconds"]
    step_ms = 1e3 / b_rate
    rows = [
        {
            "mode": "LLMEngine.step() alone, in this process",
            "steps": bare["bare"]["steps"],
            "rate": b_rate,
            "ms": step_ms,
            "x": 1.0,
        },
        {
            "mode": "engine process, a reader consuming every batch",
            "steps": att["steps"],
            "rate": a_rate,
            "ms": 1e3 / a_rate,
            "x": a_rate / b_rate,
        },
    ]
    section.tables.append(
        Table(
            f"{n} requests ({prompt} prompt tokens, {new} new) on random Llama-2-7B weights (fp16), "
            f"{att['num_blocks']:,}-block pool on {att['device']}",
            [
                ("mode", "mode", ""),
                ("steps", "steps", "d"),
                ("rate", "steps/s", ".1f"),
                ("ms", "ms a step", ".2f"),
                ("x", "x bare", ".2f"),
            ],
            rows,
        )
    )
    rec = bare["recorded"]["record_ms"]
    section.notes.append(
        f"The engine process's record a step (live state, batch, shared memory, pickling): "
        f"{rec:.3f} ms beside a {step_ms:.2f} ms step ({rec / step_ms:.1%}); "
        f"{att['whole']} batches decoded whole by the reader."
    )
    section.data.update(bare=bare, attached=att)
    section.check(
        "steps counted by the reader",
        att["steps"],
        f"= bare's {bare['bare']['steps']}",
        att["steps"] == bare["bare"]["steps"],
    )
    section.check("errors from the engine process", att["errors"] or "none", "none", not att["errors"])
    section.check(
        "attached / bare steps a second", f"{a_rate / b_rate:.2f}x", ">= 0.95x", a_rate >= 0.95 * b_rate, hard=False
    )
