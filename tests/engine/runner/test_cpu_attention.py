"""The CPU decode kernel (``cpu_attention``) against PyTorch's ops (``torch_ref``), its fallbacks, the engine on it."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner import cpu_kernels
from engine.runner.attention import cpu_attention, torch_ref
from tests.conftest import hf_greedy
from tests.engine.runner.test_triton_paged import SEQS, make_meta

if cpu_attention.kernel() is None and os.environ.get("KVSCOPE_REQUIRE_COMPILER") == "1":  # CI: a fail, not a skip
    raise RuntimeError("no C compiler: the CPU decode kernel cannot be built (scripts/setup_display.sh installs gcc)")
pytestmark = pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C compiler: the kernel cannot be built")


@pytest.fixture
def fresh_kernel(monkeypatch):
    """The kernel's cached state cleared for the test and put back after it."""
    saved = dict(cpu_kernels._state)
    cpu_kernels._state.clear()
    yield
    cpu_kernels._state.clear()
    cpu_kernels._state.update(saved)


@pytest.mark.parametrize(
    "bs,heads,kv_heads,head_dim",
    [(8, 4, 4, 64), (16, 6, 2, 64), (32, 9, 3, 64), (16, 8, 1, 128), (4, 2, 2, 20)],
)
def test_the_kernel_matches_torch_on_mixed_steps(bs, heads, kv_heads, head_dim):
    """Decode rows from the kernel, prefill rows from torch_ref, in one step of mixed sequences."""
    torch.manual_seed(bs + heads)
    nb = 64
    kc = torch.randn(nb, bs, kv_heads, head_dim)
    vc = torch.randn(nb, bs, kv_heads, head_dim)
    meta = make_meta(SEQS, bs, nb, device="cpu")
    q = torch.randn(meta.query_start_loc[-1], heads, head_dim)
    scale = head_dim**-0.5
    got = cpu_attention.paged_attention(q, kc, vc, meta, scale)
    want = torch_ref.paged_attention(q, kc, vc, make_meta(SEQS, bs, nb, device="cpu"), scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_decode_only_steps_and_long_contexts():
    torch.manual_seed(1)
    bs, nb = 16, 400
    seqs = [(n, 1) for n in (0, 1, 15, 16, 17, 700, 2047)]
    kc, vc = torch.randn(nb, bs, 3, 64), torch.randn(nb, bs, 3, 64)
    q = torch.randn(len(seqs), 9, 64) * 4  # large scores: the softmax's exp spans its range
    got = cpu_attention.paged_attention(q, kc, vc, make_meta(seqs, bs, nb, device="cpu"), 0.125)
    want = torch_ref.paged_attention(q, kc, vc, make_meta(seqs, bs, nb, device="cpu"), 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_switched_off_it_is_torch_ref(fresh_kernel, monkeypatch):
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "torch")
    assert cpu_attention.kernel() is None
    kc, vc = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    meta = make_meta([(3, 1), (6, 1)], 4, 8, device="cpu")
    q = torch.randn(2, 2, 16)
    assert torch.equal(
        cpu_attention.paged_attention(q, kc, vc, meta, 0.25), torch_ref.paged_attention(q, kc, vc, meta, 0.25)
    )


def test_no_compiler_is_one_warning_and_the_engine_still_serves(fresh_kernel, monkeypatch, tmp_path, caplog, tiny_hf):
    """A build that cannot happen (no compiler) leaves PyTorch's ops, one log line, nothing in the cache folder."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert cpu_attention.kernel() is None
        engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=64)
        prompt = [5, 9, 2, 7]
        out = LLM.from_engine(engine).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    warnings = [r for r in caplog.records if "kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_hf, prompt, 6)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))


def test_a_failed_build_leaves_no_half_written_library(fresh_kernel, monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    # answers --version; a build writes half a file where -o points, then fails
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && { echo fake 1; exit 0; }\n'
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo half > "$2"; shift; done\nexit 1\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cpu_attention.kernel() is None
    folder = tmp_path / "cache" / "kvscope" / "kernels"
    assert folder.is_dir() and not any(folder.iterdir())  # the half file was removed, nothing named .so


def test_the_engine_runs_the_kernel_and_equals_transformers(tiny_hf):
    engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=64)
    assert engine.runner.backend == "cpu"
    prompts = [[5, 9, 2, 7], [3, 3, 8, 1, 4, 4, 2, 9, 11], [7]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for p, o in zip(prompts, LLM.from_engine(engine).generate(prompts, params)):
        assert o.outputs[0].token_ids == hf_greedy(tiny_hf, p, 12)
