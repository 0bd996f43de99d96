"""Helpers for forcing failures: an engine driver that checks every step, and what a failing
device operation leaves behind (noise in the slots it was to write)."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.inspect.replay import PoolReplayer
from engine.inspect.snapshot import state_counts

GREEDY = dict(temperature=0.0, ignore_eos=True)


class Boom(RuntimeError):
    """The injected failure."""


def assert_replay_matches(rp: PoolReplayer, pool, ledger) -> None:
    assert rp.ref_cnt.tolist() == [b.ref_cnt for b in pool.blocks]
    assert list(rp.free_queue) == pool.free_queue.ids()
    assert rp.block_hash == [b.block_hash.hex() if b.block_hash else None for b in pool.blocks]
    assert_pool_arrays_match(pool, ledger)


def assert_tables_match(kv) -> None:
    """The block tables as ids (what the runner and snapshots read) equal the tables of blocks."""
    assert kv.req_to_block_ids == {rid: [b.block_id for b in bl] for rid, bl in kv.req_to_blocks.items()}


def assert_pool_arrays_match(pool, ledger) -> None:
    """The arrays and maps a snapshot copies (the pool's ledger) equal the block objects they record."""
    assert ledger.ref_cnt_arr.tolist() == [b.ref_cnt for b in pool.blocks]
    assert ledger.has_hash_arr.tolist() == [b.block_hash is not None for b in pool.blocks]
    assert ledger.free_order.order().tolist() == pool.free_queue.ids()
    assert dict(ledger.tokens_by_block.items()) == {b.block_id: b.token_ids for b in pool.cached.values()}
    assert dict(ledger.hash_hex_by_block.items()) == {b.block_id: b.block_hash.hex() for b in pool.cached.values()}
    # the blocks per state the ledger counts as they change: what a count over the snapshot's states gives
    assert ledger.state_counts() == state_counts(ledger.ref_cnt_arr, ledger.has_hash_arr)


class Checked:
    """Steps an engine; after every step the audit is clean and the replayed event stream
    equals the live pool (ref counts, free queue order, hashes)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.replayer = PoolReplayer(engine.pool.num_blocks)
        self.outputs: dict[str, object] = {}
        self.events: list = []

    def step(self):
        out = self.engine.step()
        self.events += out.events
        self.replayer.apply_all(out.events)
        assert_replay_matches(self.replayer, self.engine.pool, self.engine.ledger)
        assert_tables_match(self.engine.kv)
        report = self.engine.audit()
        assert report.ok, str(report)
        for o in out.outputs:
            if o.finished:
                assert o.request_id not in self.outputs, f"{o.request_id} finished twice"
                self.outputs[o.request_id] = o
        return out

    def drain(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.engine.has_unfinished():
                break
            self.step()
        assert not self.engine.has_unfinished()
        assert self.engine.pool.num_free_blocks == self.engine.pool.num_blocks
        assert self.engine.kv.cpu_pool.num_free_blocks == self.engine.kv.cpu_pool.num_blocks

    def tokens(self, rid: str) -> list[int]:
        return self.outputs[rid].outputs[0].token_ids


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What a fresh engine generates for these prompts (each alone, no pressure)."""
    from engine import LLM

    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [o.outputs[0].token_ids for o in outs]


def noise_into(cache: torch.Tensor, index: torch.Tensor) -> None:
    """Write large random values over ``cache[index]`` (blocks, or flat slots of a (slots, ...) view)."""
    g = torch.Generator().manual_seed(1234)
    cache[index] = (torch.randn(cache[index].shape, generator=g) * 50).to(cache.dtype)


def scribble_step_slots(runner, sched) -> None:
    """What a forward that dies half-way leaves: noise in every slot the step was to write."""
    bs = runner.block_size
    slots = [
        s.block_ids[p // bs] * bs + p % bs
        for s in sched.scheduled
        for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
    ]
    if not slots:
        return
    idx = torch.tensor(slots)
    for pair in runner.kv_caches:
        for cache in pair:
            noise_into(cache.view(-1, *cache.shape[2:]), idx)


def failing_execute(runner, when=lambda sched: True, scribble: bool = True):
    """A ``runner.execute`` that fails (after writing noise into the step's slots) when ``when(sched)``."""
    real = runner.execute
    calls = {"failed": 0}

    def execute(sched):
        if when(sched):
            calls["failed"] += 1
            if scribble:
                scribble_step_slots(runner, sched)
            raise Boom("the forward died half-way")
        return real(sched)

    execute.calls = calls
    return execute


def failing_copy(runner, kind: str, times: int = 1):
    """Replace one kind of device copy ("swap_out", "swap_in", "copy_on_write") with one that
    writes noise into its destination blocks and raises, ``times`` times."""
    name = {"swap_out": "swap_out_blocks", "swap_in": "swap_in_blocks", "copy_on_write": "copy_on_write"}[kind]
    real = getattr(runner, name)
    state = {"left": times, "failed": 0}

    def copy(pairs):
        if state["left"] <= 0:
            return real(pairs)
        state["left"] -= 1
        state["failed"] += 1
        dst = torch.tensor([b for _, b in pairs])
        caches = runner.cpu_caches if kind == "swap_out" else runner.kv_caches
        for pair in caches:
            for cache in pair:
                noise_into(cache, dst)
        raise Boom(f"{kind} copy died half-way")

    setattr(runner, name, copy)
    return state
