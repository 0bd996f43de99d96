"""Engine and sampling configuration (vLLM's names and defaults).

``EngineConfig`` is the one source of every engine option: each field's metadata
(``help``, ``choices``, bounds, the CLI group) drives ``validate()``, the command
line (``kvscope/cli/parser.py`` generates its engine flags from it) and the keys a
scenario file may set (``kvscope/scenario.py``).
"""

from __future__ import annotations

import enum
import functools
import math
import types
import typing
from dataclasses import Field, dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
KV_CACHE_DTYPES = ("auto", "fp8", "int8", "int4")  # see runner/kv_quant.py
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
KV_LAYOUTS = ("paged", "contiguous")
HASH_ALGOS = ("sha256", "builtin", "sha256_cbor")
# the free queue's order (engine/core/eviction.py): vLLM's LRU, or LFU with dynamic ageing
EVICTION_POLICIES = ("lru", "lfu")
# see KVCacheManager and Scheduler.finish_request; "shared-write": after a prefix hit, the new tokens' slots are
# off by one, so the first one overwrites the last slot of a cached block that other requests share (ModelRunner)
FAULTS = (None, "abort-leak", "cow-leak", "double-free", "shared-write")
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes; per-sample seeds are derived modulo 2**64


def option(
    default: Any = None,
    help: str = "",
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    group: str = "engine",
    scenario: bool = True,
    aliases: tuple[str, ...] = (),
    default_factory: Any = None,
) -> Any:
    """A config field with its metadata: ``help``, closed ``choices``, bounds (``ge``/``gt``/``le``),
    the command-line ``group``, extra flag ``aliases``, and whether a scenario file may set it."""
    meta = {
        "help": help,
        "choices": choices,
        "ge": ge,
        "le": le,
        "gt": gt,
        "group": group,
        "scenario": scenario,
        "aliases": aliases,
    }
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes one engine instance. ``None`` means "derive it"."""

    model: str | None = option(
        None,
        "a short name (llama-2-7b, tinyllama, ...), a hub id, a local folder or a .gguf file; "
        "default: the embedded SmolLM2-135M-Instruct",
        group="model",
        scenario=False,
    )
    tokenizer: str | None = option(
        None, "load this tokenizer (hub id or folder) instead of the model's own", group="model", scenario=False
    )
    device: str = option("auto", "cpu, cuda, cuda:N; auto picks cuda when available", group="model", scenario=False)
    dtype: str = option(
        "auto",
        "weights and activations; auto keeps the checkpoint's dtype (fp32 for GGUF)",
        choices=DTYPES,
        group="model",
    )
    block_size: int = option(16, "tokens per KV block", ge=1, group="KV cache")
    num_gpu_blocks: int | None = option(
        None, "number of physical blocks in the pool (overrides every sizing rule)", ge=1, group="KV cache"
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "size the pool by bytes (block bytes = 2 x layers x kv_heads x head_dim x dtype x block)",
        ge=1,
        group="KV cache",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "on CUDA: fraction of the GPU's memory for weights + activations + the KV pool",
        gt=0.0,
        le=1.0,
        group="KV cache",
    )
    cpu_kv_cache_bytes: int = option(
        2 << 30, "on the CPU: the most bytes the default-sized pool may take", ge=1, group="KV cache"
    )
    swap_space: float = option(4.0, "GiB of CPU pool for swap preemption", ge=0.0, group="KV cache")
    num_cpu_blocks: int | None = option(
        None, "blocks of the CPU swap pool (overrides --swap-space)", ge=0, group="KV cache"
    )
    max_num_seqs: int = option(64, "most requests running at once", ge=1, group="scheduler")
    max_num_batched_tokens: int = option(
        2048, "token budget of one step (long prompts are prefilled in chunks)", ge=1, group="scheduler"
    )
    max_model_len: int | None = option(
        None,
        "cap the context length (default: the model's); a smaller cap fits a smaller KV pool",
        ge=2,
        group="KV cache",
    )
    enable_prefix_caching: bool = option(
        True,
        "automatic prefix caching (--no-prefix-caching turns it off)",
        group="KV cache",
        aliases=("--no-prefix-caching",),
    )
    preemption_mode: str = option(
        "recompute", "what preemption does with a request's KV", choices=PREEMPTION_MODES, group="scheduler"
    )
    kv_cache_dtype: str = option(
        "auto",
        "store KV quantized: fp8 (e4m3, a scale per head), int8 (a scale per token and head), "
        "int4 (int4 V with int8 K); about 2x the blocks of a 16-bit cache in the same memory",
        choices=KV_CACHE_DTYPES,
        group="KV cache",
    )
    attention_backend: str = option(
        "auto",
        "paged attention: triton kernels (the default on CUDA), cpu (the default on the CPU: decode from a C "
        "kernel over the paged cache, the rest as torch) or torch (PyTorch's ops, the reference)",
        choices=ATTENTION_BACKENDS,
        group="model",
    )
    enforce_eager: bool = option(False, "on CUDA: do not capture CUDA graphs for decode", group="model")
    fuse_ops: bool = option(
        True,
        "with the Triton and the CPU backends: fused kernels for RMSNorm with the residual add, "
        "rotary with the KV store, and SiLU-and-mul (--no-fuse-ops: PyTorch's ops one by one, a "
        "baseline)",
        group="model",
    )
    # "contiguous": each request reserves max_model_len of KV at admission, as systems before
    # PagedAttention did (a baseline for the benchmarks; prefix caching is off with it).
    kv_layout: str = option(
        "paged",
        "contiguous reserves max_model_len per request (a pre-PagedAttention baseline; no prefix caching)",
        choices=KV_LAYOUTS,
        group="KV cache",
    )
    hash_algo: str = option(
        "sha256",
        "block hash: sha256 (kvscope's: the model's identity in every hash), builtin "
        "(fast, non-cryptographic; hits still compare tokens), or sha256_cbor (vLLM's "
        "--prefix-caching-hash-algo sha256_cbor, seeded by PYTHONHASHSEED as vLLM is: a router "
        "computes the same hashes for kvscope as for vLLM; docs/fleet.md)",
        choices=HASH_ALGOS,
        group="KV cache",
    )
    eviction_policy: str = option(
        "lru",
        "which cached free block is evicted first: lru (vLLM's: least recently freed) or lfu (least "
        "frequently used, with dynamic ageing: prefixes hit often outlive one-off long prompts, and empty blocks "
        "go before any cached one)",
        choices=EVICTION_POLICIES,
        group="KV cache",
    )
    seed: int = option(
        0, f"seed of the default sampling generator (0..{MAX_SEED})", ge=0, le=MAX_SEED, group="scheduler"
    )
    fault: str | None = option(
        None, "switch on a deliberate bug, to practise finding leaks", choices=FAULTS, group="debugging"
    )

    def validate(self) -> None:
        """Check every field against its annotation and metadata; raises ``ValueError`` with one line."""
        for f in fields(self):
            check_value(f, getattr(self, f.name))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_type(cls: type, f: Field) -> tuple[type, bool]:
    """(base type, whether None is allowed) of a field, from its annotation."""
    tp = _hints(cls)[f.name]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else str(x)


def check_value(f: Field, value: Any, cls: type = EngineConfig) -> None:
    name, m = f.name, f.metadata
    tp, optional = field_type(cls, f)
    if value is None:
        if optional:
            return
        raise ValueError(f"{name} must be set (got None)")
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, tp)
    if not ok:
        what = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(tp, tp)
        raise ValueError(f"{name} must be {what}, got {value!r}")
    choices = m.get("choices")
    if choices is not None and value not in choices:
        named = [str(c) for c in choices if c is not None]
        extra = " or None" if None in choices else ""
        raise ValueError(f"{name} must be one of {', '.join(named)}{extra}, got {value!r}")
    ge, gt, le = m.get("ge"), m.get("gt"), m.get("le")
    if gt is not None and le is not None and not gt < value <= le:
        raise ValueError(f"{name} must be in ({_fmt(gt)}, {_fmt(le)}], got {value!r}")
    if ge is not None and le is not None and not ge <= value <= le:
        raise ValueError(f"{name} must be in {_fmt(ge)}..{_fmt(le)}, got {value!r}")
    if ge is not None and value < ge:
        raise ValueError(f"{name} must be >= {_fmt(ge)}, got {value!r}")
    if gt is not None and value <= gt:
        raise ValueError(f"{name} must be > {_fmt(gt)}, got {value!r}")


def config_fields() -> tuple[Field, ...]:
    return fields(EngineConfig)


def scenario_keys() -> frozenset[str]:
    """The EngineConfig fields a scenario file may set (not the machine's: model, tokenizer, device)."""
    return frozenset(f.name for f in fields(EngineConfig) if f.metadata.get("scenario", True))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a seeded request: its own stream, always in 0..MAX_SEED."""
    return (seed + 1_000_003 * index) % (MAX_SEED + 1)


class RequestOutputKind(enum.IntEnum):
    """What ``LLMEngine.step`` reports for a request (vLLM's names and values): every step its whole output
    so far, or only its final one (``LLM.generate`` asks for that: no per-step copies of a growing list)."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings (vLLM's ``SamplingParams``)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    n: int = 1
    seed: int | None = None  # 0..MAX_SEED; sample i of n draws from derive_seed(seed, i)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Beam search: deterministic, so temperature, top_p, top_k and seed do not apply;
    # ``n`` (<= beam_width) is how many of the best beams are returned.
    use_beam_search: bool = False
    beam_width: int = 4
    length_penalty: float = 1.0
    early_stopping: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        self.validate()

    def validate(self) -> None:
        """Everything a step could trip over later is refused here, with one line."""
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be None or an integer in 0..{MAX_SEED} (2**64 - 1), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "use_beam_search", "early_stopping"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.use_beam_search:
            if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
                raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
            if self.n > self.beam_width:
                raise ValueError(f"beam search returns at most beam_width={self.beam_width} beams, but n={self.n}")
            if not _number(self.length_penalty) or not math.isfinite(self.length_penalty):
                raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
