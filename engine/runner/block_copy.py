"""Swap copies between the device pool and the CPU pool, as a few large copies rather than many small ones.

A swap moves whole blocks, one tensor per layer and part (K, V). Indexing a device pool by block ids
and assigning into a pinned CPU pool (``cpu[dst] = dev[src].to("cpu")``) goes through a pageable
temporary and a second copy on the host at a fraction of the link's speed. Here a swap-out gathers the
blocks on the device into one contiguous tensor, then copies each run of consecutive CPU block ids
straight into the pinned pool (the CPU pool hands out consecutive ids when it can, so a request's blocks
are usually one run); a swap-in copies the runs into a device tensor and scatters it into the pool on
the device. Quantized pools keep the plain indexed copy (``kv_quant.copy_blocks``).
"""

from __future__ import annotations

import torch

from .kv_quant import QuantizedKV, copy_blocks


def runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first id, position in ids, length)`` of each run of consecutive ids, in order."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and b == out[-1][0] + out[-1][2] and i == out[-1][1] + out[-1][2]:
            first, at, n = out[-1]
            out[-1] = (first, at, n + 1)
        else:
            out.append((b, i, 1))
    return out


def swap_blocks(dev_caches: list[tuple], cpu_caches: list[tuple], pairs: list[tuple[int, int]], to_cpu: bool) -> None:
    """``pairs``: (device block, CPU block) for a swap-out, (CPU block, device block) for a swap-in."""
    if not to_cpu:
        pairs = [(d, c) for c, d in pairs]
    pairs = sorted(pairs, key=lambda p: p[1])  # CPU ids in order: the runs are as long as they can be
    dev_ids = [d for d, _ in pairs]
    cpu_ids = [c for _, c in pairs]
    cpu_runs = runs(cpu_ids)
    first = dev_caches[0][0]
    device = first.data.device if isinstance(first, QuantizedKV) else first.device
    dev_index = torch.tensor(dev_ids, dtype=torch.long).to(device)
    cpu_index = torch.tensor(cpu_ids, dtype=torch.long)
    for dev_pair, cpu_pair in zip(dev_caches, cpu_caches):
        for dev, cpu in zip(dev_pair, cpu_pair):
            if isinstance(dev, QuantizedKV):
                if to_cpu:
                    copy_blocks(cpu, cpu_index, dev, torch.tensor(dev_ids))
                else:
                    copy_blocks(dev, torch.tensor(dev_ids), cpu, cpu_index)
                continue
            if to_cpu:
                staged = dev.index_select(0, dev_index)
                for first, at, n in cpu_runs:
                    cpu[first : first + n].copy_(staged[at : at + n], non_blocking=True)
            else:
                staged = torch.empty((len(pairs), *dev.shape[1:]), dtype=dev.dtype, device=dev.device)
                for first, at, n in cpu_runs:
                    staged[at : at + n].copy_(cpu[first : first + n], non_blocking=True)
                dev.index_copy_(0, dev_index, staged)
    if device.type == "cuda":
        # The copies are asynchronous; a failure must surface here, as this swap's (DeviceCopyError).
        torch.cuda.current_stream(device).synchronize()
