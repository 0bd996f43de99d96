"""``EngineState``: what an ``LLMEngine`` holds once set up, declared once for the two halves that share it
(``EngineLoading`` sets it up, ``EngineInspection`` reads it), with the views of it that tests and tools read."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import EngineConfig
    from .core.block_pool import BlockPool
    from .core.kv_cache_manager import KVCacheManager
    from .core.request import Request
    from .core.scheduler import Scheduler
    from .inspect.audit import AuditProblem
    from .inspect.pool_ledger import PoolLedger
    from .inspect.snapshot import LiveRow
    from .output_processor import OutputProcessor
    from .request_groups import RequestGroups
    from .runner.model_runner import ModelRunner
    from .runner.models.loader import LoadedWeights, ModelSource


class EngineState:
    """Every attribute here is set by ``EngineLoading._setup`` (or a constructor) before the engine is used."""

    config: EngineConfig
    device: torch.device
    source: ModelSource
    tokenizer: object  # a transformers tokenizer, or None for a model without one
    max_model_len: int
    runner: ModelRunner
    eos_token_ids: frozenset[int]
    vocab_size: int
    ledger: PoolLedger  # the inspector's record of the pool
    pool: BlockPool
    kv: KVCacheManager
    scheduler: Scheduler
    output: OutputProcessor
    request_groups: RequestGroups
    reported_problems: set[tuple[int, str]]
    write_problems: dict[tuple[int, str], AuditProblem]
    step_count: int
    num_prompt_tokens_computed: int
    num_failed_steps: int
    weights: LoadedWeights | None
    load_seconds: float
    _live_rows: dict[str, LiveRow]

    @property
    def model_name(self) -> str:
        return self.source.name

    # -- what the groups hold (the names tests and tools read) ----------------------------
    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished sequence, by id."""
        return self.request_groups.requests

    @property
    def groups(self) -> dict[str, list[Request]]:
        return self.request_groups.groups

    @property
    def beam_groups(self):
        return self.request_groups.beam_groups

    @property
    def finished_log(self):
        """The last ``MAX_FINISHED`` finished sequences (what snapshots show)."""
        return self.request_groups.finished_log

    @property
    def num_generated_tokens(self) -> int:
        return self.output.num_generated_tokens

    def enable_write_audit(self) -> None:  # EngineInspection's
        raise NotImplementedError
