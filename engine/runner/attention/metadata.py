"""What attention needs to read a step's KV through block tables."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Tokens of a step are flattened: sequence ``i`` owns rows ``query_start_loc[i]:[i+1]``.

    ``seq_lens[i]`` is its context length once this step's tokens are written;
    ``block_tables`` is padded with 0 (padding is masked by ``seq_lens``).
    """

    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    block_tables: torch.Tensor  # [B, max_blocks] int64
    seq_lens: torch.Tensor  # [B] int64
    query_start_loc: list[int]  # B + 1 host ints
    seq_lens_host: list[int]
    block_size: int
    # Sequences with exactly one new token are batched together (decode).
    decode_seqs: torch.Tensor  # indices into the batch
    decode_tokens: torch.Tensor  # their row in the flattened tokens
    prefill_seqs: list[int]
    backend_state: dict = field(default_factory=dict)  # per-step tensors a backend builds once, not per layer

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)
