"""The real oracle: the embedded SmolLM2-135M-Instruct against transformers' generate."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about memory pages."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Explain a KV cache in one sentence."},
    ],
]
MAX = 24


@pytest.fixture(scope="module")
def references(smollm2):
    model, tok, _ = smollm2
    refs = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX, do_sample=False)
        refs.append((ids[0].tolist(), out[0, ids.shape[1] :].tolist()))
    return refs


@pytest.mark.parametrize(
    "config",
    [
        {"num_gpu_blocks": 64},
        {"num_gpu_blocks": 64, "enable_prefix_caching": False},
        {"num_gpu_blocks": 7, "block_size": 16},  # three chats cannot all fit: preemption
        {"num_gpu_blocks": 40, "block_size": 4, "max_num_batched_tokens": 32},  # chunked prefill
    ],
)
def test_smollm2_greedy_matches_transformers(smollm2, references, config):
    model, tok, src = smollm2
    engine = LLMEngine.from_hf_model(model, tok, name=src.name, **config)
    outs = LLM.from_engine(engine).generate(CHATS, SamplingParams(max_tokens=MAX, temperature=0.0))
    for (prompt_ids, ref), out in zip(references, outs):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    m = engine.metrics()
    if config.get("num_gpu_blocks") == 7:
        assert m["num_preemptions"] > 0
    if config.get("enable_prefix_caching", True):
        assert m["prefix_cache_hits"] > 0  # the default system prompt is shared
    assert engine.audit().ok


def test_smollm2_text_prompt_and_stop_string(smollm2):
    model, tok, src = smollm2
    llm = LLM.from_engine(LLMEngine.from_hf_model(model, tok, name=src.name, num_gpu_blocks=32))
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=20, temperature=0))[0]
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)[
        0, ids.shape[1] :
    ]
    assert out.outputs[0].token_ids == ref.tolist()
    text = out.outputs[0].text
    word = text.split()[1]
    cut = llm.generate("The capital of France is", SamplingParams(max_tokens=20, temperature=0, stop=[word]))[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].text == text[: text.find(word)]
