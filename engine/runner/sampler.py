"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from ..config import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """``logits``: ``[N, V]`` float32 on the model's device, one row per sampled sequence.

    Everything stays on the device; the only host transfer is the final token ids. A row
    whose generator lives elsewhere (a seeded request's CPU generator) draws on that device,
    so a seed gives the same tokens on any device.
    """
    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sp, idx = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = sp.cumsum(0) - sp > p.top_p
            sp[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, idx, sp)
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        out[i] = torch.multinomial(probs, 1, generator=gen)[0].to(out.device)
    return out.tolist()
