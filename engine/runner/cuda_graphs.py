"""CUDA graphs for decode steps: one graph per padded batch size, replayed on static buffers.

A decode step (every sequence adds one token) has the same kernels for a given batch
size, so launching them costs more than running them on a small batch. Each captured
graph covers the whole step on the device: the forward and the logits (the sampler then
reads them). Its inputs live in one int64 buffer (``DecodeInputs``): the host fills a
pinned mirror of it and one copy a step moves it to the device, so a step costs one
host-to-device copy and one replay. Padding rows store nothing (slot -1), read one cached
slot (context 1), and are dropped. Without a GPU (``emulate=True``, for tests) the same
buffers and padding run eagerly, so everything but the capture itself is checked on the CPU.
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


class DecodeInputs:
    """A decode step's inputs, ``[ids | positions | slots | context lengths | block tables]`` for up to
    ``max_batch`` rows, in one int64 buffer on the device and its host mirror (pinned on CUDA, so the
    copy is asynchronous). A batch of ``b`` rows needs the buffer's first ``4 * max_batch + b * width``
    values: one copy."""

    def __init__(self, max_batch: int, width: int, device: torch.device) -> None:
        n = self.max_batch = max_batch
        self.width = width
        total = 4 * n + n * width
        self.host = torch.zeros(total, dtype=torch.long, pin_memory=device.type == "cuda")
        self.device = torch.zeros(total, dtype=torch.long, device=device)
        h, d = self.host.numpy(), self.device
        self.ids, self.positions, self.slots, self.seq_lens = (h[i * n : (i + 1) * n] for i in range(4))
        self.tables = h[4 * n :].reshape(n, width)
        self.input_ids, self.positions_d, self.slot_mapping, self.seq_lens_d = (
            d[i * n : (i + 1) * n] for i in range(4)
        )
        self.block_tables = d[4 * n :].view(n, width)
        self.rows = torch.arange(n, dtype=torch.long, device=device)
        self.seq_lens[:] = 1
        self.slots[:] = -1

    def fill(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]], b: int) -> None:
        """Rows ``0..n-1`` from the lists, rows ``n..b-1`` as padding; a table row's entries past its
        length keep older values, which attention never reads (it masks by the context length)."""
        n = len(tokens)
        self.ids[:n] = tokens
        self.positions[:n] = positions
        self.slots[:n] = slots
        self.seq_lens[:n] = positions
        self.seq_lens[:n] += 1
        t = self.tables
        for i, row in enumerate(tables):
            t[i, : len(row)] = row
        if b > n:
            self.ids[n:b] = 0
            self.positions[n:b] = 0
            self.slots[n:b] = -1
            self.seq_lens[n:b] = 1
            t[n:b, 0] = 0

    def upload(self, b: int) -> None:
        span = 4 * self.max_batch + b * self.width
        self.device[:span].copy_(self.host[:span], non_blocking=True)


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches,
        attention,
        store,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        emulate: bool = False,
        ops=None,
    ) -> None:
        self.model, self.kv_caches, self.attention, self.store = model, kv_caches, attention, store
        self.ops = ops  # the fused kernels (fused.FusedOps), or None: PyTorch's ops
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.emulate = emulate
        self.inputs = DecodeInputs(self.sizes[-1], max_blocks_per_seq, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each size's logits, [b, vocab] float32
        self.num_replays = 0
        self.pool_bytes = 0  # what the captured graphs' private pool took (measured at capture)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, b: int) -> AttentionMetadata:
        # Host-side lists are placeholders: the decode path reads only device tensors.
        x = self.inputs
        return AttentionMetadata(
            x.slot_mapping[:b],
            x.block_tables[:b],
            x.seq_lens_d[:b],
            list(range(b + 1)),
            [1] * b,
            self.block_size,
            x.rows[:b],
            x.rows[:b],
            [],
        )

    def _forward(self, b: int) -> torch.Tensor:
        x = self.inputs
        hidden = self.model(
            x.input_ids[:b], x.positions_d[:b], self.kv_caches, self._meta(b), self.attention, self.store, self.ops
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, in one shared memory pool."""
        if self.emulate:
            return
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
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
        self.pool_bytes = max(0, torch.cuda.memory_reserved() - reserved)
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s (%.2f GiB)",
            self.sizes,
            time.perf_counter() - t0,
            self.pool_bytes / 2**30,
        )

    def run(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits of a decode-only step of ``n <= max_batch`` sequences: ``[n, vocab]`` float32."""
        n = len(tokens)
        b = next(s for s in self.sizes if s >= n)
        self.inputs.fill(tokens, positions, slots, tables, b)
        self.inputs.upload(b)
        self.num_replays += 1
        if self.emulate:
            return self._forward(b)[:n]
        self.graphs[b].replay()
        return self.outputs[b][:n]
