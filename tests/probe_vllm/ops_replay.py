"""The recorder's ops, replayed, are vLLM's pool after every step (runs in the vLLM environment;
test_probe_ops_replay.py starts it). A load on vLLM's real scheduler (shared prefixes, preemption, groups from
``--groups``) is recorded by the probe's Recorder alone (no socket, no kvscope); after each step the ops are applied
to a plain model of the pool (ref counts, hashes, the free queue, the hash map's entries) and compared with what
vLLM holds, block by block. Then a write outside the pool's methods, as a manager's copy-on-write makes it, must be
an op too. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add, make_scheduler, step  # noqa: E402

import kvscope_vllm_probe.constants as c  # noqa: E402
from kvscope_vllm_probe.recorder import Recorder  # noqa: E402


class Model:
    """The pool as the ops say it is."""

    def __init__(self, pool) -> None:
        self.ref = [b.ref_cnt for b in pool.blocks]
        self.hash = [b._block_hash for b in pool.blocks]
        self.free = free_queue(pool)
        self.map: Counter = Counter((k, b.block_id) for k, b in map_entries(pool))

    def apply(self, ops: list[list]) -> None:
        for op in ops:
            code = op[0]
            if code == c.OP_REF:
                self.ref[op[1]] = op[2]
            elif code == c.OP_HASH:
                self.hash[op[1]] = op[2]
            elif code == c.OP_POP:
                for b in op[1]:
                    assert self.free[0] == b, f"popped {b}, the queue's head is {self.free[0]}"
                    self.free.pop(0)
            elif code == c.OP_REMOVE:
                self.free.remove(op[1])
            elif code == c.OP_APPEND:
                self.free.extend(op[1])
            elif code == c.OP_PREPEND:
                self.free[:0] = op[1]
            elif code == c.OP_MAP_INSERT:
                self.map[(op[1], op[2])] += 1
            elif code == c.OP_MAP_POP:
                self.map[(op[1], op[2])] -= 1
                if not self.map[(op[1], op[2])]:
                    del self.map[(op[1], op[2])]
            elif code == c.OP_MAP_CLEAR:
                self.map.clear()
            else:
                assert code == c.OP_REQUEST, code

    def differences(self, pool) -> list[str]:
        out = []
        null = pool.null_block.block_id
        for blk in pool.blocks:
            b = blk.block_id
            if b != null and self.ref[b] != blk.ref_cnt:
                out.append(f"block {b}: ref {self.ref[b]} told, {blk.ref_cnt} in vLLM")
            if self.hash[b] != blk._block_hash:
                out.append(f"block {b}: hash {self.hash[b]!r} told, {blk._block_hash!r} in vLLM")
        if self.free != free_queue(pool):
            out.append(f"free queue {self.free[:8]}... told, {free_queue(pool)[:8]}... in vLLM")
        if self.map != Counter((k, b.block_id) for k, b in map_entries(pool)):
            out.append("hash map differs")
        return out


def free_queue(pool) -> list[int]:
    out, node = [], pool.free_block_queue.fake_free_list_head.next_free_block
    while node is not None and node.block_id >= 0:
        out.append(node.block_id)
        node = node.next_free_block
    return out


def map_entries(pool):
    for key, held in pool.cached_block_hash_to_block._cache.items():
        blocks = held.values() if isinstance(held, dict) else [held]
        for b in blocks:
            yield key, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default="full")
    ap.add_argument("--num-blocks", type=int, default=50)
    args = ap.parse_args()
    s = make_scheduler(args.num_blocks, 16, max_num_seqs=8, max_num_batched_tokens=2048, groups=args.groups)
    pool = s.kv_cache_manager.block_pool
    rec = Recorder(s, 16)
    rec.install()
    model = Model(pool)
    rec.take()
    problems: list[str] = []
    steps = 0
    shared = list(range(1000, 1064))  # four blocks every request shares (prefix-cache hits)
    for i in range(24):
        add(s, f"r{i}", shared + [2000 + i] * (40 + 13 * (i % 5)), max_tokens=30 + 7 * (i % 4))
    while step(s):
        steps += 1
        ops, _touched, _adm = rec.take()
        model.apply(ops)
        problems += [f"step {steps}: {d}" for d in model.differences(pool)]
        if len(problems) > 20 or steps > 2000:
            break
    # a write outside the pool's methods, as a manager's copy-on-write makes it: the hook records it
    blk = next(b for b in pool.blocks if b.ref_cnt == 0 and not b.is_null)
    blk.ref_cnt += 1
    stray, _t, _a = rec.take()
    model.apply(stray)
    problems += [f"after a stray write: {d}" for d in model.differences(pool)]
    blk.ref_cnt -= 1
    rec.take()
    preempted = rec.preemptions
    print(
        json.dumps(
            {
                "steps": steps,
                "problems": problems[:20],
                "stray_ops": stray,
                "preemptions": preempted,
                "finished": not s.has_requests(),
            }
        )
    )


if __name__ == "__main__":
    main()
