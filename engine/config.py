"""Engine and sampling configuration (vLLM's names and defaults)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
FAULTS = (None, "abort-leak", "cow-leak", "double-free")  # see KVCacheManager and LLMEngine.abort


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes one engine instance. ``None`` means "derive it"."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: the checkpoint's dtype (fp32 for GGUF)
    block_size: int = 16
    num_gpu_blocks: int | None = None  # overrides every other sizing rule
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30  # default pool on the CPU: 2 GiB
    swap_space: float = 4.0  # GiB of CPU pool for swap preemption
    num_cpu_blocks: int | None = None  # overrides swap_space
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | int8 | int4 (V int4, K int8): see kv_quant.py
    attention_backend: str = "auto"  # torch | triton | auto
    enforce_eager: bool = False  # on CUDA: no CUDA graphs for decode
    # "contiguous": each request reserves max_model_len of KV at admission, as systems before
    # PagedAttention did (a baseline for the benchmarks; prefix caching is off with it).
    kv_layout: Literal["paged", "contiguous"] = "paged"
    hash_algo: str = "sha256"
    seed: int = 0
    fault: str | None = None  # a deliberate bug for leak-hunting practice: see FAULTS

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8", "int4"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8, int8 or int4, got {self.kv_cache_dtype!r}")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be paged or contiguous, got {self.kv_layout!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(f for f in FAULTS if f)} or None, got {self.fault!r}")
        if self.swap_space < 0 or (self.num_cpu_blocks is not None and self.num_cpu_blocks < 0):
            raise ValueError("swap_space and num_cpu_blocks must be >= 0")
        if self.hash_algo not in ("sha256", "builtin"):
            raise ValueError(f"hash_algo must be sha256 or builtin, got {self.hash_algo!r}")


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings (vLLM's ``SamplingParams``)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Beam search: deterministic, so temperature, top_p, top_k and seed do not apply;
    # ``n`` (<= beam_width) is how many of the best beams are returned.
    use_beam_search: bool = False
    beam_width: int = 4
    length_penalty: float = 1.0
    early_stopping: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.use_beam_search:
            if not isinstance(self.beam_width, int) or self.beam_width < 1:
                raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
            if self.n > self.beam_width:
                raise ValueError(f"beam search returns at most beam_width={self.beam_width} beams, but n={self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
