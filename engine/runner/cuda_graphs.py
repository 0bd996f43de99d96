"""CUDA graphs for decode steps: one graph per padded batch size, replayed on static buffers.

A decode step (every sequence adds one token) has the same kernels for a given batch
size, so launching them costs more than running them on a small batch. Each captured
size owns a slice of static input buffers; a step copies its inputs in, pads the rest
(slot -1 stores nothing, a context of 1 reads one cached slot), replays, and reads the
first ``n`` rows back. Without a GPU (``emulate=True``, for tests) the same buffers and
padding run eagerly, so everything but the capture itself is checked on the CPU.
"""
from __future__ import annotations

import logging
import time

import torch

from .attention.metadata import AttentionMetadata

logger = logging.getLogger("engine")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, up to the first size that holds ``max_num_seqs``."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8)
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


class DecodeGraphs:
    def __init__(self, model, kv_caches, attention, store, device: torch.device, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, emulate: bool = False) -> None:
        self.model, self.kv_caches, self.attention, self.store = model, kv_caches, attention, store
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.emulate = emulate
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.long, device=device)
        self.rows = torch.arange(n, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, b: int) -> AttentionMetadata:
        # Host-side lists are placeholders: the decode path reads only device tensors.
        return AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                                 list(range(b + 1)), [1] * b, self.block_size, self.rows[:b], self.rows[:b], [])

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b),
                          self.attention, self.store)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, in one shared memory pool."""
        if self.emulate:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.sizes):
            with torch.cuda.stream(stream):
                self._forward(b)  # warm-up: compiles the kernels outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = g
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes,
                    time.perf_counter() - t0)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode-only step of ``n <= max_batch`` sequences: ``[n, hidden]``."""
        n = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Padding rows: store nothing, attend to one slot of block 0, and are dropped.
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[n:b].fill_(1)
        self.block_tables[n:b, 0].zero_()
        self.num_replays += 1
        if self.emulate:
            return self._forward(b)[:n]
        self.graphs[b].replay()
        return self.outputs[b][:n]
