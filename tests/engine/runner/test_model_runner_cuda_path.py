"""The CUDA-only machinery, checked on the CPU: pool budgeting, decode graphs' buffers, weight loading."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from engine.runner.memory import GiB, KVPoolPlan
from engine.runner.models.llama import LlamaForCausalLM
from tests.conftest import hf_greedy


def test_capture_sizes_follow_vllm():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]  # the last size holds max_num_seqs


def plan(**kw) -> KVPoolPlan:
    # Llama-2-7B on an 80 GB card: 32 layers x 32 kv heads x 128 x fp16 x 16 tokens = 8 MiB a block.
    args = dict(
        total_bytes=80 * GiB,
        weights_bytes=int(12.55 * GiB),
        activation_peak_bytes=2 * GiB,
        other_bytes=GiB // 2,
        utilization=0.9,
        block_bytes=2 * 32 * 32 * 128 * 2 * 16,
        block_size=16,
        max_model_len=4096,
    )
    args.update(kw)
    return KVPoolPlan(**args)


def test_pool_plan_arithmetic_and_message():
    p = plan()
    budget = int(80 * GiB * 0.9) - int(12.55 * GiB) - 2 * GiB - GiB // 2
    assert p.kv_budget_bytes == budget and p.num_blocks == budget // (8 * 2**20)
    assert p.max_concurrency == pytest.approx(p.num_blocks * 16 / 4096)
    p.check()
    text = p.describe()
    assert "weights 12.55 GiB" in text and "activation peak 2.00 GiB" in text and f"{p.num_blocks} blocks" in text


def test_pool_too_small_for_one_request_says_so_with_numbers():
    small = plan(total_bytes=16 * GiB)  # 14.4 GiB usable: the weights and activations leave no room
    with pytest.raises(ValueError, match="cannot hold one request of 4096 tokens") as e:
        small.check()
    assert "needs 256 blocks" in str(e.value) and "--gpu-memory-utilization" in str(e.value)


def test_decode_graph_buffers_pad_and_match_eager(tiny_hf):
    """Everything of the graph path but the capture: static buffers, padding rows, slicing."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10] * 11]  # 3 sequences -> padded to a batch of 4
    engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny-llama", block_size=4, num_gpu_blocks=64, max_num_seqs=5)
    r = engine.runner
    r.decode_graphs = DecodeGraphs(
        r.model, r.kv_caches, r.attention, r.store, r.device, 5, -(-engine.max_model_len // 4), 4, emulate=True
    )
    assert r.decode_graphs.sizes == [1, 2, 4, 8]
    out = LLM.from_engine(engine).generate(prompts, params)
    assert r.decode_graphs.num_replays >= 11  # every decode step went through the buffers
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(tiny_hf, p, 12) for p in prompts]


def test_engine_loads_consume_the_source_projections(tiny_hf):
    src = copy.deepcopy(tiny_hf)
    model = LlamaForCausalLM.from_hf(src, consume=True)
    attn = src.model.layers[0].self_attn
    assert attn.q_proj.weight.numel() == 0 and src.model.layers[0].mlp.up_proj.weight.numel() == 0
    ref = LlamaForCausalLM.from_hf(tiny_hf)  # a borrowed model is left untouched
    assert tiny_hf.model.layers[0].self_attn.q_proj.weight.numel() > 0
    assert torch.equal(model.layers[1].qkv_proj.weight, ref.layers[1].qkv_proj.weight)


def test_loading_from_a_folder_keeps_the_checkpoint_dtype(tiny_hf, tmp_path):
    half = copy.deepcopy(tiny_hf).to(torch.bfloat16)
    half.save_pretrained(tmp_path)
    engine = LLMEngine(model=str(tmp_path), num_gpu_blocks=16, block_size=4, device="cpu")
    assert engine.runner.dtype == torch.bfloat16 and engine.runner.kv_caches[0][0].dtype == torch.bfloat16
