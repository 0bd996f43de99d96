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


@dataclass(slots=True)
class SampledRows:
    """The rows of a step whose output is read (each sampling sequence's last token), and what attention needs to
    compute those rows alone: one query a sequence at its last position over its whole context, a decode step's
    shape, which every backend runs.

    The last layer needs nothing else: every row's K and V are stored before attention, and no later layer reads
    the other rows. So in a prefill step its attention, output projection and MLP run on these rows only (what
    llama.cpp does with its output ids): all but the last layer's QKV projection of its matmuls, so a little under
    1/num_layers of the step's."""

    rows: torch.Tensor  # [S] rows of the step's flattened tokens
    meta: AttentionMetadata  # S sequences of one token each

    def take(self, *step_rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """These rows of each of the step's tensors (``[T, ...]``), in this order."""
        return tuple(x[self.rows] for x in step_rows)


def sampled_rows(meta: AttentionMetadata, seqs: list[int]) -> SampledRows | None:
    """The last row of each sequence in ``seqs`` (indices into the batch), or None where that is every row (a
    decode step: nothing to leave out)."""
    if len(seqs) == len(meta.slot_mapping):
        return None
    dev = meta.seq_lens.device
    idx = torch.tensor(seqs, dtype=torch.long).to(dev)
    rows = torch.tensor([meta.query_start_loc[i + 1] - 1 for i in seqs], dtype=torch.long).to(dev)
    each = torch.arange(len(seqs), dtype=torch.long, device=dev)
    return SampledRows(
        rows=rows,
        meta=AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows],
            block_tables=meta.block_tables[idx],
            seq_lens=meta.seq_lens[idx],
            query_start_loc=list(range(len(seqs) + 1)),
            seq_lens_host=[meta.seq_lens_host[i] for i in seqs],
            block_size=meta.block_size,
            decode_seqs=each,
            decode_tokens=each,
            prefill_seqs=[],
        ),
    )
