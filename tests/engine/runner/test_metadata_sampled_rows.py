"""The last layer on the sampling rows only (``SampledRows``): the same hidden states for those rows as the whole
step's, the same K/V stored for every row, on PyTorch's ops and on the fused ones."""

from __future__ import annotations

import pytest
import torch

from engine.runner.attention import cpu_attention, torch_ref
from engine.runner.attention.metadata import sampled_rows
from engine.runner.fused import fused_ops_for
from engine.runner.models.llama import LlamaForCausalLM
from tests.engine.runner.test_triton_paged import SEQS, make_meta

BS, NUM_BLOCKS = 8, 64


def caches(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, BS, model.num_kv_heads, model.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]


@pytest.mark.parametrize("path", ["pytorch", "fused"])
@pytest.mark.parametrize("sampling", [[0, 1, 2, 3, 4, 5, 6, 7], [1, 3, 5], [2], []])
def test_the_sampling_rows_and_every_rows_kv_are_the_whole_steps(tiny_hf, path, sampling):
    model = LlamaForCausalLM.from_hf(tiny_hf)
    ops, attention = None, torch_ref.paged_attention
    if path == "fused":
        ops, why = fused_ops_for(model, 4096, "cpu")
        if ops is None:
            pytest.skip(why)
        attention = cpu_attention.paged_attention
    meta = make_meta(SEQS, BS, NUM_BLOCKS, device="cpu")  # the model and its pool are on the CPU
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (meta.query_start_loc[-1],))
    pos = torch.cat([torch.arange(c, c + n) for c, n in SEQS])
    whole_kv, some_kv = caches(model), caches(model)
    whole = model(ids, pos, whole_kv, meta, attention, torch_ref.store_kv, ops)
    sampled = sampled_rows(meta, sampling)
    assert sampled is not None  # SEQS has prefills: some rows are left out
    some = model(
        ids, pos, some_kv, make_meta(SEQS, BS, NUM_BLOCKS, device="cpu"), attention, torch_ref.store_kv, ops, sampled
    )
    last = [meta.query_start_loc[i + 1] - 1 for i in sampling]
    assert some.shape == (len(sampling), model.config.hidden_size)
    torch.testing.assert_close(some, whole[last], rtol=1e-5, atol=1e-5)
    for (wk, wv), (sk, sv) in zip(whole_kv, some_kv):
        assert torch.equal(wk, sk) and torch.equal(wv, sv)  # the last layer's K/V too, for every row


def test_a_decode_step_leaves_nothing_out():
    meta = make_meta([(5, 1), (0, 1), (40, 1)], BS, NUM_BLOCKS, device="cpu")
    assert sampled_rows(meta, [0, 1, 2]) is None
    mixed = make_meta([(5, 1), (0, 9), (40, 1)], BS, NUM_BLOCKS, device="cpu")
    s = sampled_rows(mixed, [0, 1, 2])
    assert s is not None and s.rows.tolist() == [0, 9, 10]
    assert s.meta.seq_lens_host == [6, 9, 41] and not s.meta.prefill_seqs and s.meta.decode_seqs.tolist() == [0, 1, 2]
