"""A model runner without weights: the engine's scheduler, block pool, prefix cache, preemption and
events all run for real; only the forward pass is replaced, by the cost model's step time on a
virtual clock.

It offers what ``LLMEngine`` asks of ``ModelRunner`` (and ``bench/common.py``'s fake runner shows
the least of it): ``execute`` returns one token per request whose step reaches its last token,
``apply_device_work`` has no KV to move but charges swaps' copies to the clock, and ``num_blocks``,
``block_bytes``, ``num_cpu_blocks`` and ``vocab_size`` describe the simulated model's pool.
"""

from __future__ import annotations

from ..config import EngineConfig
from ..core.scheduler import SchedulerOutput
from .costmodel import CostModel


def pool_blocks(config: EngineConfig, cost: CostModel, kv_tokens: float | None = None) -> tuple[int, str]:
    """(blocks, why): ``num_gpu_blocks``, else ``kv_tokens`` (a capacity in tokens), else
    ``kv_cache_memory_bytes``, else what fits beside the weights on the simulated cards."""
    bs = config.block_size
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks, "--num-gpu-blocks"
    if kv_tokens is not None:
        return max(1, int(kv_tokens) // bs), f"--kv-tokens {int(kv_tokens):,}"
    if config.kv_cache_memory_bytes is not None:
        return max(1, int(config.kv_cache_memory_bytes // (cost.kv_bytes_per_token * bs))), "kv_cache_memory_bytes"
    n = cost.kv_capacity_tokens(config.gpu_memory_utilization) // bs
    if n < 1:
        raise ValueError(
            f"{cost.model.name} leaves no room for a KV cache on {cost.tp} x {cost.gpu.name}: "
            "give --sim-tp, a bigger card, or a pool size"
        )
    return n, f"{cost.tp} x {cost.gpu.name} at gpu_memory_utilization {config.gpu_memory_utilization}"


class SimRunner:
    """Stands in for ``ModelRunner``; ``clock`` is the virtual time in seconds, advanced by every step."""

    backend = "simulated"
    decode_graphs = None
    pool_plan = None
    dtype = "bfloat16"  # what the window's title shows
    device = "cpu"

    def __init__(self, config: EngineConfig, cost: CostModel, num_blocks: int) -> None:
        self.config = config
        self.cost = cost
        self.model_config = cost.model  # answers max_position_embeddings and eos_token_id (LLMEngine.from_runner)
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.vocab_size = cost.model.vocab_size
        self.block_bytes = int(cost.kv_bytes_per_token * config.block_size)
        if config.preemption_mode != "swap":
            self.num_cpu_blocks = 0
        elif config.num_cpu_blocks is not None:
            self.num_cpu_blocks = config.num_cpu_blocks
        else:
            self.num_cpu_blocks = int(config.swap_space * 2**30) // self.block_bytes
        self.write_observer = None  # the engine's write audit sets it; nothing is written here
        self.clock = 0.0  # virtual seconds
        self.busy_s = 0.0  # of which the card was computing or copying
        self.num_steps = 0

    def apply_device_work(self, sched: SchedulerOutput) -> None:
        """No KV to move: swaps cost their bytes over the host link; copy-on-write copies are ignored
        (a few blocks on the card's own bandwidth, and workloads never fork)."""
        n = len(sched.swap_out) + len(sched.swap_in)
        if n:
            t = self.cost.copy_time(n * self.block_bytes)
            self.clock += t
            self.busy_s += t

    def execute(self, sched: SchedulerOutput) -> tuple[dict[str, int], dict]:
        """Advance the clock by the step's time; sample one token for every request that reaches its end.

        The token is a function of the request's length (never an EOS: the simulated model has none), so
        runs are reproducible. No logits are returned: n > 1 and beam search need them, workloads do not.
        """
        t = self.cost.step_time([(s.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled])
        self.clock += t
        self.busy_s += t
        self.num_steps += 1
        vocab = self.vocab_size
        return {
            s.request.request_id: (s.request.num_tokens * 7919 + 1) % vocab for s in sched.scheduled if s.samples
        }, {}

    def sample(self, logits, reqs: list) -> list[int]:
        """What the engine calls for n > 1 samples' first tokens (never, for a workload)."""
        return [(r.num_tokens * 7919 + 1) % self.vocab_size for r in reqs]
