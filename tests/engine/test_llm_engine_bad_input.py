"""Bad input gets a clear error, changes nothing, and the engine keeps serving."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.runner.models.loader import ModelNotFoundError, resolve_model

OK = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def serves(engine) -> bool:
    out = LLM.from_engine(engine).generate([[5, 6, 7]], OK)[0]
    return len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("", "empty"),
        ([], "empty"),
        ("hello", "no tokenizer"),
        ([1, 2, 99999], "outside the vocabulary"),
        ([1, -1], "outside the vocabulary"),
        (3.5, "must be a string"),
        ([{"role": "user", "content": "hi"}], "chat template"),
    ],
)
def test_bad_prompts(tiny_engine, prompt, message):
    engine = tiny_engine()
    keep = engine.add_request([1, 2, 3], OK)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, OK)
    assert list(engine.requests) == [keep]
    assert serves(engine)


def test_prompt_larger_than_the_pool(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="can never fit.*whole pool has 8"):
        engine.add_request(list(range(1, 40)), OK)
    assert serves(engine)


def test_prompt_longer_than_the_context(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=1024, block_size=4)
    with pytest.raises(ValueError, match="context is 512"):
        engine.add_request([1] * 600, OK)
    assert serves(engine)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"n": 0}, "n must be"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"block_size": 0}, "block_size"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"dtype": "float8"}, "dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_bad_engine_config(tiny_hf, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine.from_hf_model(tiny_hf, None, **kwargs)


def test_unknown_model_lists_what_it_tried():
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("no-such-model-xyz")
    msg = str(e.value)
    assert "cannot find model 'no-such-model-xyz'" in msg and "local path" in msg and "short name" in msg
    assert "\n" not in msg


def test_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a model"):
        resolve_model(str(tmp_path))


def test_alias_resolves_to_hub_id_even_offline():
    with pytest.raises(ModelNotFoundError, match="meta-llama/Llama-2-7b-hf"):
        resolve_model("llama-2-7b")


def test_cuda_without_cuda_is_one_clear_line(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        LLMEngine(EngineConfig(model="no-such-model", device="cuda"))


def test_duplicate_request_id(tiny_engine):
    engine = tiny_engine()
    engine.add_request([1, 2], OK, request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], OK, request_id="a")
    assert serves(engine)


def test_a_failing_model_step_fails_only_its_requests(tiny_engine, monkeypatch):
    engine = tiny_engine()
    rid = engine.add_request([1, 2, 3], OK)
    real = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda sched: (_ for _ in ()).throw(RuntimeError("boom")))
    out = engine.step()
    assert out.error == "RuntimeError: boom"
    assert out.outputs[0].request_id == rid and out.outputs[0].finished and out.outputs[0].error
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and engine.audit().ok
    monkeypatch.setattr(engine.runner, "execute", real)
    assert serves(engine)


def test_params_made_invalid_after_construction_are_refused_at_add_request(tiny_engine):
    engine = tiny_engine()
    bad = SamplingParams(max_tokens=4)
    bad.max_tokens = 0  # dataclasses do not re-validate on assignment: add_request does
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1, 2, 3], bad)
    assert not engine.requests and serves(engine)


def test_a_kv_budget_smaller_than_one_block_is_refused(tiny_hf):
    with pytest.raises(ValueError, match="0 blocks"):
        LLMEngine.from_hf_model(tiny_hf, None, kv_cache_memory_bytes=100, block_size=4)


def test_cached_kv_is_never_shared_across_models_or_tokenizers(tiny_hf):
    from engine.core.request import Request

    prompt = list(range(1, 17))
    hashes = []
    for name, tok in (("model-a", None), ("model-b", None)):
        engine = LLMEngine.from_hf_model(tiny_hf, tok, name=name, num_gpu_blocks=16, block_size=4)
        hashes.append(engine.kv.block_hashes(Request("x", 0, prompt, OK), 16))
    assert not set(hashes[0]) & set(hashes[1])  # the model's identity is in every block hash
    engine = LLMEngine.from_hf_model(tiny_hf, None, name="model-a", num_gpu_blocks=16, block_size=4)
    engine.kv.extra_keys = ("model-a::", "other-tokenizer", engine.vocab_size)
    assert not set(engine.kv.block_hashes(Request("y", 0, prompt, OK), 16)) & set(hashes[0])


def test_gated_model_without_credentials_says_how_to_get_access(monkeypatch):
    import transformers

    def gated(name, *a, **k):
        raise OSError(f"You are trying to access a gated repo. Access to model {name} is restricted (401).")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", gated)
    with pytest.raises(ModelNotFoundError, match="is gated.*hf auth login") as e:
        resolve_model("llama-2-7b")
    assert "meta-llama/Llama-2-7b-hf" in str(e.value) and "\n" not in str(e.value)
