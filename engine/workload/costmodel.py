"""How long one engine step takes on a named card, for a named model: a roofline, in one file.

A step runs every scheduled token through the model once. It is as slow as the slower of

- **memory**: the bytes it reads: the weights once (every token of the step shares that read),
  plus each scheduled request's KV cache up to its new tokens (attention reads the whole context;
  a decode step of many long contexts is dominated by this), against the card's HBM bandwidth;
- **compute**: 2 x parameters FLOPs per token (a multiply-add per weight) plus attention's
  4 x layers x heads x head_dim FLOPs per (token, earlier token) pair (QK^T and AV), against the
  card's dense 16-bit tensor throughput.

Decode steps are memory-bound, prefill steps compute-bound; a mixed step (chunked prefill with
decodes riding along) pays the larger of the two. Only a fraction of the peaks is reached in
practice: ``bandwidth_efficiency`` and ``compute_efficiency`` (the defaults are typical of a tuned
serving engine; they are assumptions, printed with every run). A model too large for one card is
split over ``tp`` cards (tensor parallel) that add up their bandwidth and compute, with no cost for
their communication. What is left out: the per-step CPU overhead, sampling, communication, and any
difference between kernels; what is kept: the shape of the costs (prefill grows with prompt x
context, decode with the number and length of contexts), which is what queues arrivals.

The figures are the vendors' data-sheet numbers (dense, no sparsity) and the models' published
configurations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class SimModel:
    """A decoder's shape: what its weights and KV cache weigh."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    context_length: int
    vocab_size: int

    # what LLMEngine reads from a checkpoint's config (LLMEngine.from_runner)
    @property
    def max_position_embeddings(self) -> int:
        return self.context_length

    eos_token_id = None  # workloads generate to max_tokens (ignore_eos): no token ends a request early

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> float:
        """K and V of one token over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class SimGPU:
    """One card's data-sheet peaks."""

    name: str
    memory_bytes: float
    bandwidth: float  # HBM/GDDR bytes per second
    flops: float  # dense fp16/bf16 tensor FLOP/s
    host_bandwidth: float  # host link bytes per second (swap preemption copies over it)


MODELS: dict[str, SimModel] = {
    m.name: m
    for m in (
        SimModel("llama-2-7b", 32, 4096, 32, 32, 128, 6.74e9, 4096, 32000),
        SimModel("llama-2-13b", 40, 5120, 40, 40, 128, 13.0e9, 4096, 32000),
        SimModel("llama-2-70b", 80, 8192, 64, 8, 128, 69.0e9, 4096, 32000),
        SimModel("llama-3-8b", 32, 4096, 32, 8, 128, 8.03e9, 8192, 128256),
        SimModel("llama-3-70b", 80, 8192, 64, 8, 128, 70.6e9, 8192, 128256),
        SimModel("llama-3.1-8b", 32, 4096, 32, 8, 128, 8.03e9, 131072, 128256),
        SimModel("llama-3.1-70b", 80, 8192, 64, 8, 128, 70.6e9, 131072, 128256),
        # Qwen2.5: 32k native, 128k with YaRN rope scaling (as Qwen documents; the config ships 32k)
        SimModel("qwen2.5-7b", 28, 3584, 28, 4, 128, 7.62e9, 131072, 152064),
        SimModel("qwen2.5-14b", 48, 5120, 40, 8, 128, 14.8e9, 131072, 152064),
        SimModel("qwen2.5-72b", 80, 8192, 64, 8, 128, 72.7e9, 131072, 152064),
    )
}

GPUS: dict[str, SimGPU] = {
    g.name: g
    for g in (
        SimGPU("h100", 80 * GB, 3.35e12, 989e12, 55e9),  # SXM
        SimGPU("h200", 141 * GB, 4.8e12, 989e12, 55e9),
        SimGPU("a100-80gb", 80 * GB, 2.039e12, 312e12, 25e9),  # SXM
        SimGPU("l40s", 48 * GB, 0.864e12, 362e12, 25e9),
        SimGPU("rtx-4090", 24 * GB, 1.008e12, 165e12, 25e9),  # bf16 with fp32 accumulate
        SimGPU("mi300x", 192 * GB, 5.3e12, 1307e12, 55e9),
    )
}

DEFAULT_MODEL = "llama-3.1-8b"  # a 128k context: Mooncake's prompts reach 126k (conversation) and 191k tokens
DEFAULT_GPU = "h100"
KV_DTYPE_BYTES = {"auto": 2, "fp8": 1, "int8": 1, "int4": 0.75}  # int4: V in 4 bits, K in 8 (runner/kv_quant.py)


def find(table: dict, name: str, what: str):
    item = table.get(name.lower())
    if item is None:
        raise ValueError(f"unknown {what} {name!r} (known: {', '.join(table)})")
    return item


@dataclass(frozen=True, slots=True)
class CostModel:
    model: SimModel
    gpu: SimGPU
    tp: int = 1  # cards the model is split over
    weight_bytes_per_param: float = 2  # bf16
    kv_dtype_bytes: float = 2
    bandwidth_efficiency: float = 0.8
    compute_efficiency: float = 0.5

    @classmethod
    def named(
        cls, model: str = DEFAULT_MODEL, gpu: str = DEFAULT_GPU, tp: int | None = None, kv_cache_dtype: str = "auto"
    ) -> CostModel:
        """``tp=None``: the fewest cards (a power of two) whose memory holds the weights twice over,
        leaving at least as much for the KV cache as the weights take."""
        m, g = find(MODELS, model, "--sim-model"), find(GPUS, gpu, "--sim-gpu")
        weights = m.num_params * 2
        if tp is None:
            tp = 1
            while weights > 0.5 * tp * g.memory_bytes:
                tp *= 2
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        return cls(m, g, tp, kv_dtype_bytes=find(KV_DTYPE_BYTES, kv_cache_dtype, "kv_cache_dtype"))

    @property
    def weight_bytes(self) -> float:
        return self.model.num_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_bytes_per_token(self.kv_dtype_bytes)

    @property
    def bandwidth(self) -> float:
        """Bytes per second reached, all cards together."""
        return self.gpu.bandwidth * self.tp * self.bandwidth_efficiency

    @property
    def flops(self) -> float:
        """FLOP/s reached, all cards together."""
        return self.gpu.flops * self.tp * self.compute_efficiency

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """Tokens of KV that fit beside the weights (activations not counted), as vLLM sizes its pool."""
        free = self.tp * self.gpu.memory_bytes * gpu_memory_utilization - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    def step_time(self, batch: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step over ``(num_computed_tokens, num_new_tokens)`` per scheduled request."""
        m = self.model
        tokens = kv_tokens = pairs = 0
        for computed, new in batch:
            tokens += new
            kv_tokens += computed + new  # attention reads the context so far and the new tokens' K/V
            pairs += new * computed + new * (new + 1) // 2  # causal: token i attends to computed + i + 1
        if not tokens:
            return 0.0
        read = self.weight_bytes + kv_tokens * self.kv_bytes_per_token
        work = 2 * m.num_params * tokens + 4 * m.num_layers * m.num_heads * m.head_dim * pairs
        return max(read / self.bandwidth, work / self.flops)

    def copy_time(self, num_bytes: float) -> float:
        """Seconds to move KV between the card and the host (swap preemption)."""
        return num_bytes / (self.gpu.host_bandwidth * self.tp)

    def describe(self) -> str:
        """The parameters, as a short table (printed with every simulated run)."""
        m, g = self.model, self.gpu
        cards = f"{self.tp} x {g.name}" if self.tp > 1 else g.name
        kv = self.kv_bytes_per_token
        prefill = self.step_time([(0, 8192)])
        decode = self.step_time([(4096, 1)] * 64)
        rows = [
            ("simulated", f"{m.name} on {cards} (no weights: the step time below stands in for the forward pass)"),
            (
                "model",
                f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads ({m.num_kv_heads} KV) x "
                f"{m.head_dim}, {m.num_params / 1e9:.2f} B parameters, context {m.context_length:,}, "
                f"vocabulary {m.vocab_size:,}",
            ),
            (
                "bytes",
                f"weights {self.weight_bytes / GB:.1f} GB; KV {kv / 1024:.0f} KiB a token "
                f"({self.kv_dtype_bytes:g} bytes a value)",
            ),
            (
                "card",
                f"{g.memory_bytes / GB:.0f} GB, {g.bandwidth / 1e12:.2f} TB/s, {g.flops / 1e12:.0f} TFLOP/s "
                f"dense 16-bit, host link {g.host_bandwidth / GB:.0f} GB/s; assumed reached: "
                f"{self.bandwidth_efficiency:.0%} of the bandwidth, {self.compute_efficiency:.0%} of the compute",
            ),
            (
                "step",
                f"max(bytes read / {self.bandwidth / 1e12:.2f} TB/s, FLOPs / {self.flops / 1e12:.0f} TFLOP/s); "
                "bytes = weights + each request's KV so far; FLOPs = 2 x params a token + attention",
            ),
            (
                "e.g.",
                f"an 8,192-token prefill {prefill * 1e3:.0f} ms; a decode step of 64 x 4k contexts "
                f"{decode * 1e3:.1f} ms; KV that fits beside the weights: {self.kv_capacity_tokens():,} tokens",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_json(self) -> dict:
        return {
            "model": self.model.name,
            "gpu": self.gpu.name,
            "tp": self.tp,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "bandwidth_bytes_s": self.bandwidth,
            "flops": self.flops,
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "compute_efficiency": self.compute_efficiency,
        }
