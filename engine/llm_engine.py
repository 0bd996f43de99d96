"""``LLMEngine``: the step-level API (add_request, step, abort, snapshot, audit)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import numpy as np
import torch

from .beam_search import BeamGroup
from .config import EngineConfig, SamplingParams
from .core.block_pool import BlockPool
from .core.cpu_pool import CpuBlockPool
from .core.kv_cache_manager import KVCacheManager, cdiv
from .core.request import Request, RequestStatus
from .core.scheduler import Scheduler
from .inputs import PromptType, to_token_ids
from .inspect.audit import AuditReport, audit_pool
from .inspect.events import LeakFound
from .inspect.snapshot import KVSnapshot, RequestInfo, assemble_snapshot
from .outputs import CompletionOutput, RequestOutput, StepOutput
from .runner.model_runner import ModelRunner
from .runner.models.loader import ModelSource, load_hf_model, resolve_model

logger = logging.getLogger("engine")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but CUDA is not available here "
                           f"(torch {torch.__version__}); use --device cpu")
    return dev


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        config = dataclasses.replace(config, **kwargs) if config else EngineConfig(**kwargs)
        config.validate()
        device = resolve_device(config.device)
        source = resolve_model(config.model)
        t0 = time.perf_counter()
        hf_model, tokenizer = load_hf_model(source, config.dtype, device)
        self._setup(config, device, source, hf_model, tokenizer, consume=True)
        del hf_model  # its fused projections were consumed; the rest lives on in the runner
        self.load_seconds = time.perf_counter() - t0

    @classmethod
    def from_hf_model(cls, hf_model, tokenizer=None, config: EngineConfig | None = None,
                      name: str = "in-memory model", **kwargs) -> LLMEngine:
        """Serve a transformers model that is already loaded (a notebook's, a test's).

        The engine reads its weights (fusing q/k/v and gate/up into new tensors) and
        leaves the model itself untouched.
        """
        config = dataclasses.replace(config, **kwargs) if config else EngineConfig(**kwargs)
        config.validate()
        self = cls.__new__(cls)
        device = next(hf_model.parameters()).device
        self._setup(config, device, ModelSource(name, None, name), hf_model, tokenizer)
        self.load_seconds = 0.0
        return self

    def _setup(self, config: EngineConfig, device: torch.device, source: ModelSource, hf_model, tokenizer,
               consume: bool = False) -> None:
        self.config = config
        self.device = device
        self.source = source
        self.tokenizer = tokenizer
        hf_config = hf_model.config
        ctx = getattr(hf_config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(ctx, config.max_model_len or ctx)
        self.runner = ModelRunner(config, hf_model, device, self.max_model_len, consume)
        self.eos_token_ids = self._eos_ids(hf_config)
        self.vocab_size = self.runner.vocab_size
        contiguous = config.kv_layout == "contiguous"
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching and not contiguous)
        tok_id = getattr(tokenizer, "name_or_path", "") if tokenizer is not None else ""
        self.kv = KVCacheManager(self.pool, config.block_size,
                                 extra_keys=(source.identity, tok_id, self.vocab_size),
                                 hash_algo=config.hash_algo, cpu_pool=CpuBlockPool(self.runner.num_cpu_blocks),
                                 fault=config.fault, reserve_tokens=self.max_model_len if contiguous else 0)
        self.scheduler = Scheduler(config, self.kv)
        self.requests: dict[str, Request] = {}  # the unfinished ones
        self.groups: dict[str, list[Request]] = {}  # user request id -> its samples (n > 1) and forks
        self.beam_groups: dict[str, BeamGroup] = {}  # user request id -> its beam search
        self.reported_problems: set[tuple[int, str]] = set()
        self.finished_log: list[Request] = []  # every finished request, for snapshots
        self.step_count = 0
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0

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

    # -- requests ------------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, client: str = "") -> str:
        """Validate and queue a request; raises ``ValueError`` and changes nothing on bad input.

        ``client`` names the sender (an HTTP client's address), shown beside the request.
        """
        params = params or SamplingParams()
        params.validate()
        ids, text = to_token_ids(prompt, self.tokenizer, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but the model's context is "
                             f"{self.max_model_len} tokens (one more is needed to generate)")
        bs = self.config.block_size
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need = cdiv(self.max_model_len if self.config.kv_layout == "contiguous" else total, bs)
        what = f"{len(ids)} prompt + {params.max_tokens} output tokens"
        if params.use_beam_search:
            # The beams share the prompt; each needs its own blocks for its output (+1 for a CoW copy).
            need = cdiv(len(ids), bs) + params.beam_width * (cdiv(total - len(ids), bs) + 1)
            what += f" in {params.beam_width} beams"
        if need > self.pool.num_blocks:
            raise ValueError(f"this request can never fit: {what} need {need} blocks of {bs}, "
                             f"but the whole pool has {self.pool.num_blocks}")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests or rid in self.groups:
            raise ValueError(f"request id {rid!r} is already in use")
        beam = params.use_beam_search
        req = Request(rid, self._next_index(), ids, params, prompt=text, eos_token_ids=self.eos_token_ids,
                      cache_salt=cache_salt, generator=_generator(params.seed, 0),
                      pending_forks=0 if beam else params.n - 1, client=client)
        self.requests[rid] = req
        self.groups[rid] = [req]
        if beam:
            stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            group = BeamGroup(rid, params.beam_width, params.max_tokens, params.length_penalty,
                              params.early_stopping, frozenset(stop))
            group.add_beam(req, 0.0)
            self.beam_groups[rid] = group
        self.scheduler.add_request(req)
        return rid

    def _next_index(self) -> int:
        return len(self.finished_log) + len(self.requests)

    def fork(self, request_id: str) -> str:
        """Fork a running sequence on demand: the copy shares every block until it writes (CoW)."""
        parent = self.requests.get(request_id)
        if parent is None or parent.status != RequestStatus.RUNNING:
            raise ValueError(f"request {request_id} is not running: only a running sequence can fork")
        if parent.num_computed_tokens < parent.num_prompt_tokens:
            raise ValueError(f"request {request_id} is still prefilling its prompt")
        if parent.group_id in self.beam_groups:
            raise ValueError(f"request {request_id} is a beam: beam search forks its beams itself")
        parent.num_forks += 1
        child = self._spawn(parent, f"{request_id}+{parent.num_forks}", group_id=None, sample_index=0)
        child.output_token_ids = list(parent.output_token_ids)
        child.output_text = parent.output_text
        self.groups[child.request_id] = [child]
        return child.request_id

    def _spawn(self, parent: Request, child_id: str, group_id: str | None, sample_index: int) -> Request:
        seed = parent.sampling_params.seed
        child = Request(child_id, self._next_index(), list(parent.prompt_token_ids), parent.sampling_params,
                        prompt=parent.prompt, eos_token_ids=parent.eos_token_ids, cache_salt=parent.cache_salt,
                        generator=_generator(seed, sample_index or len(child_id)), group_id=group_id or "",
                        sample_index=sample_index, parent_id=parent.request_id, client=parent.client)
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child.request_id] = child
        if parent.status != RequestStatus.RUNNING:
            # A preempted or swapped beam has no device blocks to share: the child
            # recomputes (mostly from the prefix cache), ahead of newer requests.
            child.status = RequestStatus.PREEMPTED
            self.scheduler.waiting.appendleft(child)
            return child
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent, child)
        self.scheduler.running.append(child)
        return child

    def abort(self, request_id: str) -> bool:
        """Abort one sequence, or every sequence of a user request (its n samples)."""
        req = self.requests.get(request_id)
        group_id = req.group_id if req is not None else request_id
        if req is None or group_id == request_id or group_id in self.beam_groups:
            # A beam search cannot go on without one of its beams: it ends as a whole.
            targets = self.groups.get(group_id, [])
        else:
            targets = [req]
        if group_id in self.beam_groups:
            self.beam_groups[group_id].done = True
        live = [r for r in targets if not r.is_finished]
        for r in live:
            r.pending_forks = 0
            self._finish(r, RequestStatus.FINISHED_ABORTED)
        return bool(live)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(req, status)
        self.requests.pop(req.request_id, None)
        self.finished_log.append(req)

    # -- the step ----------------------------------------------------------------------
    def step(self) -> StepOutput:
        self.step_count += 1
        self.pool.step = self.step_count
        sched = self.scheduler.schedule()
        touched: list[Request] = []
        error = None
        sampled: dict[str, int] = {}
        forking: dict[str, torch.Tensor] = {}
        rounds: dict[str, BeamGroup] = {}
        try:
            self.runner.apply_device_work(sched)
            if sched.scheduled:
                sampled, forking = self.runner.execute(sched)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            error = f"{type(e).__name__}: {e}"
            logger.exception("model step %d failed", self.step_count)
            self._fail_step(sched, error)
        if error is None:
            for s in sched.scheduled:
                req = s.request
                req.num_computed_tokens += s.num_new_tokens
                if req.num_computed_tokens <= req.num_prompt_tokens:
                    self.num_prompt_tokens_computed += s.num_new_tokens
                tok = sampled.get(req.request_id)
                if tok is None:
                    continue
                group = self.beam_groups.get(req.group_id)
                if group is not None:
                    group.report(req, forking[req.request_id])
                    rounds[group.group_id] = group
                    touched.append(req)
                    continue
                if req.request_id in forking:
                    touched += self._fork_samples(req, forking[req.request_id])
                self._append_token(req, tok)
                touched.append(req)
            for group in rounds.values():
                if group.ready():
                    touched += self._beam_round(group)
        else:
            touched = [s.request for s in sched.scheduled]
        outputs = list({r.group_id: self._output(r) for r in touched}.values())
        return StepOutput(self.step_count, outputs, self.pool.drain_events(),
                          sched.num_scheduled_tokens, sampled, error)

    def _fork_samples(self, parent: Request, logits: torch.Tensor) -> list[Request]:
        """n > 1: after the prompt's prefill, the other n - 1 samples share its blocks (ref count n)."""
        children = [self._spawn(parent, f"{parent.request_id}#{i}", parent.group_id, i)
                    for i in range(1, parent.pending_forks + 1)]
        parent.pending_forks = 0
        self.groups[parent.group_id] += children
        tokens = self.runner.sample(logits.expand(len(children), -1), children)
        for child, tok in zip(children, tokens):
            self._append_token(child, tok)
        return children

    def _beam_round(self, group: BeamGroup) -> list[Request]:
        """Apply one round of beam search: fork the beams chosen more than once, prune the others."""
        head = self.groups[group.group_id][0]
        rnd = group.advance(self.max_model_len - head.num_prompt_tokens)
        for req in rnd.pruned:
            self._finish(req, RequestStatus.FINISHED_STOPPED if rnd.done else RequestStatus.FINISHED_PRUNED)
        touched = list(rnd.pruned)
        for parent, choices in rnd.continuations:
            for tok, score in choices[1:]:
                child = self._spawn(parent, f"{group.group_id}~{len(self.groups[group.group_id])}",
                                    group.group_id, len(self.groups[group.group_id]))
                child.output_token_ids = list(parent.output_token_ids)
                self.groups[group.group_id].append(child)
                self._append_beam_token(child, tok)
                group.add_beam(child, score)
                touched.append(child)
            tok, score = choices[0]
            self._append_beam_token(parent, tok)
            group.add_beam(parent, score)
            touched.append(parent)
        group.sort_beams()
        return touched

    def _append_beam_token(self, req: Request, tok: int) -> None:
        """Beam search decides when a beam ends, so no stop rule applies here."""
        req.awaiting_round = False
        self._push_token(req, tok)

    def _push_token(self, req: Request, tok: int) -> None:
        req.output_token_ids.append(tok)
        self.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if self.tokenizer is not None:
            req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)

    def _fail_step(self, sched, error: str) -> None:
        # KV of this step may be half written: unpublish the blocks it cached.
        for s in sched.scheduled:
            req = s.request
            req.error = error
            for b in self.kv.req_to_blocks.get(req.request_id, []):
                if b.ref_cnt == 1 and b.block_hash is not None and b.last_access == self.step_count:
                    self.pool.cached.pop(b.block_hash, None)
                    b.block_hash, b.token_ids = None, ()
            self._finish(req, RequestStatus.FINISHED_ERROR)
        # A beam search cannot go on without one of its beams.
        for s in sched.scheduled:
            group = self.beam_groups.get(s.request.group_id)
            if group is not None and not group.done:
                group.done = True
                for r in self.groups[group.group_id]:
                    if not r.is_finished:
                        r.error = error
                        self._finish(r, RequestStatus.FINISHED_ERROR)

    def _append_token(self, req: Request, tok: int) -> None:
        p = req.sampling_params
        self._push_token(req, tok)
        status = None
        if not p.ignore_eos and tok in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif tok in p.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif p.stop and any(s in req.output_text for s in p.stop):
            cut = min(req.output_text.find(s) for s in p.stop if s in req.output_text)
            req.output_text = req.output_text[:cut]
            status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status)

    def _output(self, req: Request) -> RequestOutput:
        """The user-visible output of the request's group: one completion per sample."""
        members = self.groups.get(req.group_id, [req])
        head = members[0]
        if len(members) == 1 and not head.pending_forks and req.group_id not in self.beam_groups:  # the common case
            comp = CompletionOutput(0, head.output_text, head.output_token_ids[:], head.status.finish_reason)
            # prompt_token_ids is never mutated after admission: shared, not copied every step.
            return RequestOutput(head.group_id, head.prompt, head.prompt_token_ids, [comp], head.is_finished,
                                 max(head.num_cached_tokens, 0), head.error)
        group = self.beam_groups.get(req.group_id)
        if group is not None:
            comps = [CompletionOutput(i, self._decode(h.token_ids), h.token_ids,
                                      ("stop" if h.stopped else "length") if group.done else None, h.cum_logprob)
                     for i, h in enumerate(group.results(head.sampling_params.n))]
        else:
            comps = [CompletionOutput(r.sample_index, r.output_text, list(r.output_token_ids),
                                      r.status.finish_reason) for r in sorted(members, key=lambda r: r.sample_index)]
        done = all(r.is_finished for r in members) and not head.pending_forks
        return RequestOutput(head.group_id, head.prompt, head.prompt_token_ids, comps, done,
                             max(head.num_cached_tokens, 0), next((r.error for r in members if r.error), None))

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # -- inspection ------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        kv = self.kv
        return {
            "kv_cache_usage_perc": self.pool.usage(),
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_blocks": len(self.pool.cached),
            "num_blocks": self.pool.num_blocks,
            "evictions": self.pool.num_evictions,
            "cow_copies": kv.num_cow_copies,
            "swap_outs": kv.num_swap_outs,
            "swap_ins": kv.num_swap_ins,
            "num_requests_swapped": len(self.scheduler.swapped),
            "num_cpu_blocks": kv.cpu_pool.num_blocks,
            "num_free_cpu_blocks": kv.cpu_pool.num_free_blocks,
            "generation_tokens": self.num_generated_tokens,
            "prompt_tokens": self.num_prompt_tokens_computed,
            "step": self.step_count,
        }

    def audit(self, emit_events: bool = False) -> AuditReport:
        """Recompute ref counts from the tables; with ``emit_events``, each new problem becomes a leak event."""
        report = audit_pool(self.pool, self.kv.req_to_blocks)
        if emit_events:
            for p in report.problems:
                key = (p.block_id, p.problem)
                if key not in self.reported_problems:
                    self.reported_problems.add(key)
                    self.pool.events.append(LeakFound(p.block_id, str(p)))
        return report

    def snapshot(self, max_finished: int = 64) -> KVSnapshot:
        """A copy of the pool and of the live (and last ``max_finished`` finished) requests."""
        pool = self.pool
        n = pool.num_blocks
        shown = list(self.requests.values()) + self.finished_log[-max_finished:]
        infos = [self.request_info(r) for r in shown]
        return assemble_snapshot(
            self.step_count, self.config.block_size,
            ref_cnt=np.fromiter((b.ref_cnt for b in pool.blocks), np.int32, n),
            has_hash=np.fromiter((b.block_hash is not None for b in pool.blocks), bool, n),
            last_access=np.fromiter((b.last_access for b in pool.blocks), np.int64, n),
            free_queue=np.array(pool.free_queue.ids(), np.int32), requests=infos,
            cached_tokens={b.block_id: b.token_ids for b in pool.cached.values()},
            block_hashes={b.block_id: b.block_hash.hex() for b in pool.cached.values()},
            counters=self.metrics(), num_cpu_blocks=self.kv.cpu_pool.num_blocks,
            block_bytes=self.runner.block_bytes, model_name=self.model_name)

    def request_info(self, r: Request) -> RequestInfo:
        return RequestInfo(r.request_id, r.index, r.status.name, r.num_prompt_tokens, len(r.output_token_ids),
                           max(r.num_cached_tokens, 0), r.num_computed_tokens,
                           tuple(self.kv.get_block_ids(r.request_id)), r.output_text, tuple(r.all_token_ids),
                           r.error, r.group_id, r.parent_id, tuple(r.cpu_block_ids), r.client)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    """Per-sequence generator: sample i of a seeded request draws from its own stream."""
    if seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(seed + 1_000_003 * index)
