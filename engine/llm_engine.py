"""``LLMEngine``: the step-level API (add_request, step, abort, fork, snapshot, audit).

A coordinator: the scheduler picks the step's work, the model runner runs it, the
output processor applies stop rules and builds outputs, request groups own samples,
forks and beams. What is here is the step's failure rule: anything that raises while
a step runs fails that step's requests (their blocks freed, the step's cache
publications rolled back, a swapped-out request whose copy failed recomputed), and
``step()`` itself never raises.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from operator import attrgetter

import torch

from .config import EngineConfig, RequestOutputKind, SamplingParams
from .core.block_pool import BlockPool
from .core.cpu_pool import CpuBlockPool
from .core.kv_cache_manager import KVCacheManager, cdiv
from .core.request import Request, RequestStatus
from .core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from .inputs import PromptType, to_token_ids
from .inspect.audit import AuditProblem, AuditReport, audit_pool
from .inspect.events import LeakFound
from .inspect.snapshot import KVSnapshot, LiveRow, LiveState, PoolState, RequestInfo, pool_state, request_info
from .output_processor import OutputProcessor
from .outputs import RequestOutput, StepOutput
from .request_groups import MAX_FINISHED, RequestGroups, check_user_request_id, make_generator
from .runner.device import DeviceNotAvailableError, resolve_device  # noqa: F401 - part of this module's API
from .runner.model_runner import DeviceCopyError, ModelRunner
from .runner.models.loader import LoadedWeights, ModelSource, Progress, load_model, load_tokenizer, resolve_model

logger = logging.getLogger("engine")


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, weights: LoadedWeights | None = None,
                 progress: Progress | None = None, **kwargs) -> None:
        """``weights``: an earlier engine's (``engine.weights``), reused when they are the same model,
        dtype, device and tokenizer: a new pool and scheduler over weights already in memory.
        ``progress(text, fraction)`` hears what the load is doing."""
        config = dataclasses.replace(config, **kwargs) if config else EngineConfig(**kwargs)
        config.validate()
        report = progress or (lambda _text, _fraction=None: None)
        device = resolve_device(config.device)
        source = resolve_model(config.model)
        t0 = time.perf_counter()
        key = (source.identity, config.dtype, str(device), config.tokenizer)
        if weights is not None and weights.key == key:
            report(f"reusing the weights of {source.name} already in memory", 0.6)
            self._setup(config, device, source, None, weights.tokenizer, model=weights.model, report=report)
        else:
            model, tokenizer = load_model(source, config.dtype, device, tokenizer=config.tokenizer, progress=report)
            self._setup(config, device, source, None, tokenizer, model=model, report=report)
        self.weights = LoadedWeights(key, self.runner.model, self.tokenizer)
        self.load_seconds = time.perf_counter() - t0
        report("ready", 1.0)

    @classmethod
    def from_hf_model(cls, hf_model, tokenizer=None, config: EngineConfig | None = None,
                      name: str = "in-memory model", **kwargs) -> LLMEngine:
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
    def from_model(cls, model, tokenizer=None, config: EngineConfig | None = None, name: str = "in-memory model",
                   **kwargs) -> LLMEngine:
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
    def from_runner(cls, runner, config: EngineConfig | None = None, tokenizer=None, name: str = "simulated model",
                    **kwargs) -> LLMEngine:
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

    def _setup(self, config: EngineConfig, device: torch.device, source: ModelSource, hf_model, tokenizer,
               model=None, report: Progress | None = None, runner=None) -> None:
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
        self.runner = runner if runner is not None else ModelRunner(config, hf_model, device, self.max_model_len,
                                                                     model=model)
        self.eos_token_ids = self._eos_ids(hf_config)
        self.vocab_size = self.runner.vocab_size
        if tokenizer is not None and len(tokenizer) > self.vocab_size:
            logger.warning("the tokenizer has %d tokens, the model %d: prompts with ids beyond the model's are "
                           "refused", len(tokenizer), self.vocab_size)
        contiguous = config.kv_layout == "contiguous"
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching and not contiguous,
                              config.eviction_policy)
        tok_id = getattr(tokenizer, "name_or_path", "") if tokenizer is not None else ""
        self.kv = KVCacheManager(self.pool, config.block_size,
                                 extra_keys=(source.identity, tok_id, self.vocab_size),
                                 hash_algo=config.hash_algo, cpu_pool=CpuBlockPool(self.runner.num_cpu_blocks),
                                 fault=config.fault, reserve_tokens=self.max_model_len if contiguous else 0)
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

    # -- requests ------------------------------------------------------------------------
    def validate_request(self, prompt: PromptType,
                         params: SamplingParams | None = None) -> tuple[list[int], str | None]:
        """Everything ``add_request`` checks about a prompt and its params; returns (token ids, text).

        Raises ``ValueError`` with one line; changes nothing.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
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
        return ids, text

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, client: str = "") -> str:
        """Validate and queue a request; raises ``ValueError`` and changes nothing on bad input.

        ``client`` names the sender (an HTTP client's address), shown beside the request.
        """
        params = params or SamplingParams()
        groups = self.request_groups
        if request_id is not None:
            check_user_request_id(request_id)
            if groups.is_live(request_id):
                raise ValueError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        ids, text = self.validate_request(prompt, params)
        rid = request_id if request_id is not None else groups.auto_id()
        beam = params.use_beam_search
        req = Request(rid, groups.next_index(), ids, params, prompt=text, eos_token_ids=self.eos_token_ids,
                      cache_salt=cache_salt, generator=make_generator(params.seed, 0),
                      pending_forks=0 if beam else params.n - 1, client=client)
        groups.add(req)
        return rid

    def fork(self, request_id: str) -> str:
        """Fork a running sequence on demand: the copy shares every block until it writes (CoW)."""
        return self.request_groups.fork(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort one sequence, or every sequence of a user request (its n samples)."""
        return self.request_groups.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------
    def step(self) -> StepOutput:
        """One step: schedule, copy, forward, sample, post-process. Never raises: a failure
        finishes the step's requests with ``error`` and the engine keeps serving."""
        self.step_count += 1
        self.pool.step = self.step_count
        self.request_groups.created.clear()
        touched: list[Request] = []
        sampled: dict[str, int] = {}
        error = None
        swap_outs_lost = True  # until the device work has run
        try:
            sched = self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - an engine bug must not leave requests holding blocks
            error = f"scheduling failed: {_one_line(e)}"
            logger.exception("scheduling step %d failed", self.step_count)
            sched = self._salvage_schedule()
        if error is None:
            try:
                try:
                    self.runner.apply_device_work(sched)
                except DeviceCopyError as e:
                    swap_outs_lost = e.kind == "swap-out"  # a later kind: the swap-outs had completed
                    raise
                swap_outs_lost = False
                if sched.scheduled:
                    sampled = self._run(sched, touched)
                outputs = self._outputs(touched)
                self.pool.commit_step()
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
                error = _one_line(e)
                logger.exception("step %d failed", self.step_count)
        if error is not None:
            sampled = {}
            touched += self._fail_step(sched, error, swap_outs_lost)
            outputs = self._outputs(touched, decode=False)
        self.request_groups.sweep()
        return StepOutput(self.step_count, outputs, self.pool.drain_events(), sched.num_scheduled_tokens,
                          sampled, error)

    def _run(self, sched: SchedulerOutput, touched: list[Request]) -> dict[str, int]:
        """The forward and everything after it; ``touched`` collects the requests to report."""
        sampled, forking = self.runner.execute(sched)
        groups = self.request_groups
        beam_groups = groups.beam_groups
        append_token = self.output.append_token
        final_only = RequestOutputKind.FINAL_ONLY
        token_of = sampled.get
        rounds = {}
        prompt_tokens = 0
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens = computed = req.num_computed_tokens + s.num_new_tokens
            if computed <= len(req.prompt_token_ids):
                prompt_tokens += s.num_new_tokens
            tok = token_of(req.request_id)
            if tok is None:
                continue
            if beam_groups and (beams := beam_groups.get(req.group_id)) is not None:
                beams.report(req, forking[req.request_id])
                rounds[beams.group_id] = beams
                touched.append(req)
                continue
            if forking and req.request_id in forking:
                children = groups.spawn_samples(req)
                touched += children
                # Each new sample draws its first token from the same distribution as the first.
                logits = forking[req.request_id]
                for child, t in zip(children, self.runner.sample(logits.expand(len(children), -1), children)):
                    self._append(child, t)
            status = append_token(req, tok)
            if status is not None:
                groups.finish(req, status)
                touched.append(req)
            elif req.sampling_params.output_kind is not final_only:
                touched.append(req)  # a request that wants only its final output is reported when it ends
        self.num_prompt_tokens_computed += prompt_tokens
        for beams in rounds.values():
            if beams.ready():
                touched += groups.beam_round(beams, self.max_model_len)
        return sampled

    def _append(self, req: Request, tok: int) -> None:
        status = self.output.append_token(req, tok)
        if status is not None:
            self.request_groups.finish(req, status)

    def _outputs(self, touched: list[Request], decode: bool = True) -> list[RequestOutput]:
        """One output per group that got a token or finished, in the order first touched."""
        groups = self.request_groups
        first: dict[str, Request] = {}
        for r in touched:
            first.setdefault(r.group_id, r)
        out = []
        for gid, r in first.items():
            members = groups.groups.get(gid, [r])
            if r.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY and not (
                    all(m.is_finished for m in members) and not members[0].pending_forks):
                continue  # the caller asked for the final output only: no per-step copy of the tokens
            out.append(self.output.make_output(members, groups.beam_groups.get(gid), decode))
        return out

    def _salvage_schedule(self) -> SchedulerOutput:
        """What a failed ``schedule()`` left: every request holding device blocks, and the swap-outs never run."""
        swap_out, _, _ = self.kv.take_device_work()
        lost = {c for _, c in swap_out}
        swapped = [r for r in self.scheduler.swapped if lost.intersection(r.cpu_block_ids)]
        # Anything not safely queued (running, or dropped between two queues) or holding device blocks.
        queued = {r.request_id for q in (self.scheduler.waiting, self.scheduler.swapped) for r in q}
        holding = [r for r in self.requests.values()
                   if r.request_id not in queued or r.request_id in self.kv.req_to_blocks]
        return SchedulerOutput([ScheduledRequest(r, 0, r.num_computed_tokens, []) for r in holding], swapped)

    def _fail_step(self, sched: SchedulerOutput, error: str, swap_outs_lost: bool) -> list[Request]:
        """Fail the step's requests; returns them (for the step's outputs)."""
        self.num_failed_steps += 1
        # The step's KV may be unwritten: nothing it was to complete may stay in the cache.
        self.pool.rollback_step(f"step {self.step_count} failed: {error}")
        if swap_outs_lost:
            for r in sched.preempted:
                if r.status == RequestStatus.SWAPPED:
                    self.scheduler.recompute_swapped(
                        r, f"its swap-out in step {self.step_count} never completed ({error}); recomputing")
        victims = [s.request for s in sched.scheduled] + list(self.request_groups.created)
        return self.request_groups.fail(victims, error)

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
            "num_requests_finished": sum(self.request_groups.num_finished.values()),
            "num_failed_steps": self.num_failed_steps,
            "step": self.step_count,
        }

    def enable_write_audit(self) -> None:
        """Check every block a step writes before the forward: a write into a block with ref count > 1
        or with a hash published by an earlier step corrupts KV that others read (``audit`` reports it)."""
        self.runner.write_observer = self._check_writes

    def _check_writes(self, writes: list[tuple[str, int]]) -> None:
        # Blocks published by this very step are being filled by it (requests admitted in the same step
        # may already hold them: the forward writes every slot before any attention reads it).
        publishing = {id(b) for b, _ in self.pool.tentative}
        for rid, bid in writes:
            b = self.pool.blocks[bid]
            if id(b) in publishing:
                continue
            if b.ref_cnt > 1 or b.block_hash is not None:
                why = f"ref count {b.ref_cnt}" if b.ref_cnt > 1 else "published hash"
                self.write_problems.setdefault((bid, rid), AuditProblem(
                    bid, "shared_write", 1, b.ref_cnt, f"{rid}, step {self.step_count}: write into a block with {why}"))

    def audit(self, emit_events: bool = False) -> AuditReport:
        """Recompute ref counts from the tables; with ``emit_events``, each new problem becomes a leak event.

        With ``enable_write_audit``, writes into shared or published blocks are problems too."""
        report = audit_pool(self.pool, self.kv.req_to_blocks)
        if self.write_problems:
            report = AuditReport(report.problems + tuple(self.write_problems.values()))
        if emit_events:
            for p in report.problems:
                key = (p.block_id, p.problem)
                if key not in self.reported_problems:
                    self.reported_problems.add(key)
                    self.pool.events.append(LeakFound(p.block_id, str(p)))
        return report

    def snapshot(self, max_finished: int = MAX_FINISHED) -> KVSnapshot:
        """A copy of the pool and of the live (and last ``max_finished``, at most 64) finished requests."""
        return self.pool_state(max_finished).assemble()

    def pool_state(self, max_finished: int = MAX_FINISHED) -> PoolState:
        """What ``snapshot`` is derived from, without the derived views, copied."""
        return pool_state(self.step_count, self.config.block_size, self.pool,
                          [self._snapshot_row(r) for r in self._shown(max_finished)], self.metrics(),
                          self.kv.cpu_pool.num_blocks, block_bytes=self.runner.block_bytes,
                          model_name=self.model_name)

    def live_state(self, max_finished: int = MAX_FINISHED) -> LiveState:
        """The state now, not copied (what an engine process sends): the live requests' rows as ``LiveRow``s
        (the wire sends their changes), the pool's blocks per state as it counts them, the pool itself."""
        live, rows = self._live_rows, []
        for r in self._shown(max_finished):
            if r.snapshot_row is None and not r.status.finished:
                row = live.get(r.request_id)
                if row is None or row.request is not r:
                    row = live[r.request_id] = LiveRow(r, self.kv)
                rows.append(row)
            else:
                rows.append(self._snapshot_row(r))
        if len(live) > 2 * len(self.requests) + 64:  # rows of requests that ended, dropped now and then
            self._live_rows = {rid: row for rid, row in live.items() if rid in self.requests}
        rows.sort(key=attrgetter("index"))
        return LiveState(self.step_count, self.config.block_size, tuple(rows), self.metrics(),
                         self.pool.state_counts(), self.kv.cpu_pool.num_blocks, self.runner.block_bytes,
                         self.model_name, self.pool)

    def _shown(self, max_finished: int) -> list[Request]:
        """The requests a snapshot shows: the live ones, then the last ``max_finished`` finished."""
        finished = list(self.finished_log)
        return list(self.requests.values()) + finished[max(0, len(finished) - max_finished):]

    def _snapshot_row(self, r: Request) -> RequestInfo:
        """A finished request's row never changes again: it is built once, not at every snapshot."""
        row = r.snapshot_row
        if row is not None:
            return row
        row = request_info(r, self.kv.block_ids_view(r.request_id))  # request_info copies it
        if r.status.finished:
            r.snapshot_row = row
        return row

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
