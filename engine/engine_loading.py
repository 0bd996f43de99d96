"""How an ``LLMEngine`` comes to be: over weights it loads (``LLMEngine(config)``), a transformers model already
in memory, an engine-native model, or a runner without weights; and the one ``_setup`` they share (the runner,
the block pool, the KV cache manager, the scheduler, the output processor, the request groups).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TypeVar

import torch

from .config import EngineConfig
from .core.block_pool import BlockPool
from .core.cpu_pool import CpuBlockPool
from .core.kv_cache_manager import KVCacheManager
from .core.scheduler import Scheduler
from .inspect.audit import AuditProblem
from .inspect.pool_ledger import PoolLedger
from .inspect.snapshot import LiveRow
from .output_processor import OutputProcessor
from .request_groups import RequestGroups
from .runner.model_runner import ModelRunner
from .runner.models.loader import ModelSource, Progress, load_tokenizer

logger = logging.getLogger("engine")
_Engine = TypeVar("_Engine", bound="EngineLoading")  # typing.Self is 3.11+; the project promises 3.10


class EngineLoading:
    """``LLMEngine``'s constructors (a mixin: the engine is one object; its loading reads apart)."""

    @classmethod
    def from_hf_model(
        cls: type[_Engine],
        hf_model,
        tokenizer=None,
        config: EngineConfig | None = None,
        name: str = "in-memory model",
        **kwargs,
    ) -> _Engine:
        """Serve a transformers model that is already loaded (a notebook's, a test's).

        The engine reads its weights (fusing q/k/v and gate/up into new tensors) and
        leaves the model itself untouched. Without a ``tokenizer``, ``config.tokenizer``
        (a hub id or folder) is loaded, if set.
        """
        config = dataclasses.replace(config, **kwargs) if config else EngineConfig(**kwargs)
        config.validate()
        if tokenizer is None and config.tokenizer:
            tokenizer = load_tokenizer(config.tokenizer)
        self = cls.__new__(cls)
        device = next(hf_model.parameters()).device
        self._setup(config, device, ModelSource(name, None, name), hf_model, tokenizer)
        self.weights = None  # a caller's model: its weights are the caller's to reuse
        self.load_seconds = 0.0
        return self

    @classmethod
    def from_model(
        cls: type[_Engine],
        model,
        tokenizer=None,
        config: EngineConfig | None = None,
        name: str = "in-memory model",
        **kwargs,
    ) -> _Engine:
        """An engine over an engine-native ``LlamaForCausalLM`` already built (a benchmark's random weights):
        several engines may share one model's weights, each with its own pool."""
        config = dataclasses.replace(config, **kwargs) if config else EngineConfig(**kwargs)
        config.validate()
        self = cls.__new__(cls)
        device = next(model.parameters()).device
        self._setup(config, device, ModelSource(name, None, name), None, tokenizer, model=model)
        self.weights = None
        self.load_seconds = 0.0
        return self

    @classmethod
    def from_runner(
        cls: type[_Engine],
        runner,
        config: EngineConfig | None = None,
        tokenizer=None,
        name: str = "simulated model",
        **kwargs,
    ) -> _Engine:
        """An engine over a runner without weights (``engine.workload.SimRunner``): the real scheduler, block
        pool, prefix cache, preemption and events run, and only the forward pass is the runner's.

        The runner offers what the engine asks of ``ModelRunner``: ``execute``, ``apply_device_work``,
        ``num_blocks``, ``block_bytes``, ``num_cpu_blocks``, ``vocab_size``, and a ``model_config`` that
        answers ``max_position_embeddings`` and ``eos_token_id`` in place of a checkpoint's config.
        """
        config = dataclasses.replace(config, **kwargs) if config else EngineConfig(**kwargs)
        config.validate()
        self = cls.__new__(cls)
        self._setup(config, torch.device("cpu"), ModelSource(name, None, name), None, tokenizer, runner=runner)
        self.weights = None
        self.load_seconds = 0.0
        return self

    def _setup(
        self,
        config: EngineConfig,
        device: torch.device,
        source: ModelSource,
        hf_model,
        tokenizer,
        model=None,
        report: Progress | None = None,
        runner=None,
    ) -> None:
        """``model``: an already built ``LlamaForCausalLM`` (reused weights) instead of ``hf_model``;
        ``runner``: a runner without weights instead of both (``from_runner``)."""
        self.config = config
        self.device = device
        self.source = source
        self.tokenizer = tokenizer
        if runner is not None:
            hf_config = runner.model_config
        else:
            hf_config = model.config if model is not None else hf_model.config
        ctx = getattr(hf_config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(ctx, config.max_model_len or ctx)
        if report is not None:
            report("sizing and building the KV pool", 0.85)
        self.runner = (
            runner if runner is not None else ModelRunner(config, hf_model, device, self.max_model_len, model=model)
        )
        self.eos_token_ids = self._eos_ids(hf_config)
        self.vocab_size = self.runner.vocab_size
        if tokenizer is not None and len(tokenizer) > self.vocab_size:
            logger.warning(
                "the tokenizer has %d tokens, the model %d: prompts with ids beyond the model's are refused",
                len(tokenizer),
                self.vocab_size,
            )
        contiguous = config.kv_layout == "contiguous"
        # the inspector's record of the pool (events, snapshot arrays, holders), told of every change
        self.ledger = PoolLedger(self.runner.num_blocks)
        self.pool = BlockPool(
            self.runner.num_blocks,
            config.enable_prefix_caching and not contiguous,
            config.eviction_policy,
            listener=self.ledger,
        )
        tok_id = getattr(tokenizer, "name_or_path", "") if tokenizer is not None else ""
        self.kv = KVCacheManager(
            self.pool,
            config.block_size,
            extra_keys=(source.identity, tok_id, self.vocab_size),
            hash_algo=config.hash_algo,
            cpu_pool=CpuBlockPool(self.runner.num_cpu_blocks),
            fault=config.fault,
            reserve_tokens=self.max_model_len if contiguous else 0,
        )
        self.scheduler = Scheduler(config, self.kv)
        self.output = OutputProcessor(tokenizer, self.max_model_len)
        self.request_groups = RequestGroups(self.scheduler, self.kv, self.output)
        self.reported_problems: set[tuple[int, str]] = set()
        self.write_problems: dict[tuple[int, str], AuditProblem] = {}  # see enable_write_audit
        if config.fault:  # a practice fault: the audit is on, writes included
            self.enable_write_audit()
        self.step_count = 0
        self.num_prompt_tokens_computed = 0
        self.num_failed_steps = 0
        # each running request's one LiveRow (live_state), kept here: one more attribute on every
        # Request cost its instances their shared-key dicts, and the step ~6% at 256 requests
        self._live_rows: dict[str, LiveRow] = {}

    @property
    def model_name(self) -> str:
        return self.source.name

    def _eos_ids(self, hf_config) -> frozenset[int]:
        ids: set[int] = set()
        for src in (hf_config, getattr(self, "tokenizer", None)):
            v = getattr(src, "eos_token_id", None)
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(v)
        return frozenset(ids)
