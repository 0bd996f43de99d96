"""Shared fixtures: a tiny random Llama (fast oracle) and the embedded SmolLM2 (real oracle)."""

from __future__ import annotations

import gc
import os
import signal
import sys

# Headless and offline, before Qt or transformers are imported.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A suite started in the background by a shell without job control (``nohup ... &``) has SIGINT ignored, and so
# would every kvscope it starts (an ignored signal stays ignored across exec, and Python keeps it so): the tests
# that stop kvscope with SIGINT, as Ctrl+C does, need it as a terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run under its interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLMEngine  # noqa: E402

pytest_plugins = ("file_order",)  # the longest files first (scripts/test.sh's workers finish together)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item):
    """After pytest-qt has closed a test's widgets and its fixtures are torn down, delete those windows now.

    pytest-qt only posts their deletion; left posted, a window and its plots were destroyed inside the
    next test's event loop, or inside a garbage collection there, with its engine thread running, and
    once that segfaulted CI (in a weak map's callback, under pytest-qt's exec). Here the deletion and the
    collection of what the test dropped happen between tests, where nothing else is going on."""
    result = yield
    widgets = sys.modules.get("PySide6.QtWidgets")
    if widgets is not None and widgets.QApplication.instance() is not None:
        from kvscope.ui.lifetime import delete_posted

        delete_posted()
        if {"qtbot", "qapp"} & set(item.fixturenames):
            gc.collect()
    return result


TINY_VOCAB = 256


def make_tiny_hf(kind: str = "llama", seed: int = 0, **overrides):
    """A random-weight model of a Llama-family architecture, small enough for many prompts."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    common.update(overrides)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    else:
        raise ValueError(kind)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=0
    )
    return out[0, len(prompt) :].tolist()


def byte_tokenizer():
    """A byte-level tokenizer of exactly 256 tokens (one a byte, no merges) with a small chat template.

    Built offline, it gives the tiny random Llama (vocab 256) text and chat: random bytes decode to
    text with cut UTF-8 characters, which is what streaming must cope with.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> printable character table (the one ByteLevel pre-tokenization uses).
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_hf():
    return make_tiny_hf("llama")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_hf):
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf.save_pretrained(d)
    return str(d)


@pytest.fixture
def tiny_engine(tiny_hf):
    def make(**kw) -> LLMEngine:
        kw.setdefault("num_gpu_blocks", 64)
        kw.setdefault("block_size", 4)
        return LLMEngine.from_hf_model(tiny_hf, None, name="tiny-llama", **kw)

    return make


@pytest.fixture(scope="session")
def smollm2():
    """(hf_model, tokenizer, name) of the embedded SmolLM2, loaded once per test session."""
    from engine.runner.models.loader import embedded_source, load_hf_model

    src = embedded_source()
    model, tok = load_hf_model(src, "auto", torch.device("cpu"))
    return model, tok, src
