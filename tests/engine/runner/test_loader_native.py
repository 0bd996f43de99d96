"""The engine reads safetensors straight into its own model, with transformers' weights and RoPE exactly,
and never imports a transformers model class (seconds saved at every start)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner.models import loader
from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.models.rotary import RotaryEmbedding, build_rotary
from tests.conftest import hf_greedy, make_tiny_hf

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [9] * 13, list(range(40, 70))]


@pytest.mark.parametrize(
    "kind,overrides,dtype",
    [
        ("llama", {}, None),
        ("llama", {"tie_word_embeddings": True}, torch.bfloat16),
        ("qwen2", {}, None),  # q/k/v biases
        ("llama", {"attention_bias": True, "mlp_bias": True}, None),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            None,
        ),
    ],
)
def test_a_folder_loads_natively_with_the_same_weights_and_output(tmp_path, kind, overrides, dtype):
    hf = make_tiny_hf(kind, seed=3, **overrides)
    if dtype is not None:
        hf = hf.to(dtype)
    hf.save_pretrained(tmp_path)
    native = loader.load_native(tmp_path, "auto", torch.device("cpu"))
    via_hf = LlamaForCausalLM.from_hf(hf)
    a, b = native.state_dict(), via_hf.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert type(native.rotary_emb) is RotaryEmbedding
    engine = LLMEngine(model=str(tmp_path), num_gpu_blocks=64, block_size=4, device="cpu", dtype="float32")
    out = LLM.from_engine(engine).generate(PROMPTS, GREEDY)
    ref = hf.float()
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(ref, p, 10) for p in PROMPTS]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    ],
)
def test_native_rope_equals_transformers_for_each_static_variant(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_parameters=rope)
    ours, theirs = RotaryEmbedding(config), LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.bfloat16)
    pos = torch.arange(0, 500)[None]
    for a, b in zip(ours(x, pos), theirs(x, pos)):
        assert torch.equal(a, b)


def test_dynamic_rope_keeps_the_checkpoints_own_module():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    assert type(build_rotary(config)).__name__ == "LlamaRotaryEmbedding"


def test_the_engine_process_never_imports_a_transformers_model_class(tiny_dir):
    code = (
        "import sys; from engine import LLMEngine; LLMEngine(model=sys.argv[1], num_gpu_blocks=8, block_size=4);"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and 'modeling_' in m"
        " and not m.endswith('modeling_auto')))"
    )  # the auto mapping is a table, the classes are lazy
    r = subprocess.run([sys.executable, "-c", code, tiny_dir], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_a_quantized_checkpoint_goes_through_transformers(tmp_path, monkeypatch):
    make_tiny_hf("llama").save_pretrained(tmp_path)
    calls = []
    real = loader.load_hf_model
    monkeypatch.setattr(loader, "load_hf_model", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    monkeypatch.setattr(loader, "load_native", lambda *a: (_ for _ in ()).throw(loader.NotNativeError("quantized")))
    model, _ = loader.load_model(loader.resolve_model(str(tmp_path)), "auto", torch.device("cpu"))
    assert len(calls) == 1 and model.num_layers == 2


def test_a_file_with_the_tied_pair_saved_under_the_heads_name(tmp_path):
    from safetensors.torch import save_file

    hf = make_tiny_hf("llama", seed=2, tie_word_embeddings=True)
    hf.config.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in hf.state_dict().items() if k != "model.embed_tokens.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    native = loader.load_native(tmp_path, "auto", torch.device("cpu"))
    assert torch.equal(native.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert native.lm_head.weight.data_ptr() == native.embed_tokens.weight.data_ptr()  # one tensor


def test_a_sharded_checkpoint_reads_every_shard(tmp_path):
    hf = make_tiny_hf("llama", seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(loader.native_files(tmp_path)) > 1
    native = loader.load_native(tmp_path, "auto", torch.device("cpu"))
    a, b = native.state_dict(), LlamaForCausalLM.from_hf(hf).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_a_plain_config_reads_as_its_class_does(tmp_path, kind):
    import json

    from transformers import AutoConfig

    from engine.runner.models.checkpoint_config import read_config, stated_plainly

    make_tiny_hf(kind).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert stated_plainly(d)
    plain, full = read_config(tmp_path), AutoConfig.from_pretrained(str(tmp_path))
    assert type(plain).__name__ == "PreTrainedConfig"
    for name in (
        "model_type",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "vocab_size",
        "eos_token_id",
        "sliding_window",
    ):
        assert getattr(plain, name, None) == getattr(full, name, None), name
    assert torch.equal(RotaryEmbedding(plain).inv_freq, RotaryEmbedding(full).inv_freq)
    for missing in ("tie_word_embeddings", "num_key_value_heads", "rms_norm_eps"):
        assert not stated_plainly({k: v for k, v in d.items() if k != missing})  # its class's default decides
    assert not stated_plainly({**d, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})


def test_the_converted_gguf_tokenizer_is_the_one_autotokenizer_gives(smollm2):
    from transformers import AutoTokenizer

    src = loader.embedded_source()
    folder = loader.gguf_cache_dir(src)
    assert (folder / loader.COMPLETE).is_file()  # the smollm2 fixture converted it
    ours = loader._tokenizer_of(folder, src, None)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    text = "Four score and seven years ago <|im_start|>user\nhi 12345 é\n<|im_end|>"
    assert type(ours) is type(theirs) and ours.encode(text) == theirs.encode(text)
    assert ours.chat_template == theirs.chat_template and ours.all_special_ids == theirs.all_special_ids
    ids = list(range(0, len(theirs), 97))
    assert ours.batch_decode([[i] for i in ids]) == theirs.batch_decode([[i] for i in ids])


def test_the_embedded_models_token_texts_are_cached_beside_its_conversion(smollm2):
    from engine import LLMEngine
    from kvscope.runtime import host

    engine = LLMEngine(num_gpu_blocks=8)

    class Source:
        pass

    Source.engine = engine
    cache = host.vocab_cache_file(engine)
    assert cache is not None and cache.parent == loader.gguf_cache_dir(engine.source)
    cache.unlink(missing_ok=True)
    decoded = host.vocab_of(Source)  # decoded, and written
    assert cache.is_file() and len(decoded) == engine.vocab_size
    assert host.vocab_of(Source) == decoded  # read back
    sample = list(range(0, engine.vocab_size, 211))
    assert [decoded[i] for i in sample] == engine.tokenizer.batch_decode(
        [[i] for i in sample], skip_special_tokens=False
    )
    cache.write_text("[1, 2")  # torn
    assert host.vocab_of(Source) == decoded and host.vocab_of(Source) == decoded
