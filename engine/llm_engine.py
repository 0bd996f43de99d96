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

from .config import EngineConfig, RequestOutputKind, SamplingParams
from .core.kv_cache_manager import cdiv
from .core.request import Request, RequestStatus
from .core.scheduler import ScheduledRequest, SchedulerOutput
from .engine_inspection import EngineInspection
from .engine_loading import EngineLoading
from .inputs import PromptType, to_token_ids
from .messages import one_line
from .outputs import RequestOutput, StepOutput
from .request_groups import check_user_request_id, make_generator
from .runner.device import DeviceNotAvailableError, resolve_device  # noqa: F401 - part of this module's API
from .runner.model_runner import DeviceCopyError
from .runner.models.loader import LoadedWeights, Progress, load_model, resolve_model

logger = logging.getLogger("engine")


class LLMEngine(EngineLoading, EngineInspection):
    """The step loop; its constructors are ``engine_loading``'s, its inspection ``engine_inspection``'s."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        weights: LoadedWeights | None = None,
        progress: Progress | None = None,
        **kwargs,
    ) -> None:
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
    def validate_request(
        self, prompt: PromptType, params: SamplingParams | None = None
    ) -> tuple[list[int], str | None]:
        """Everything ``add_request`` checks about a prompt and its params; returns (token ids, text).

        Raises ``ValueError`` with one line; changes nothing.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        ids, text = to_token_ids(prompt, self.tokenizer, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but the model's context is "
                f"{self.max_model_len} tokens (one more is needed to generate)"
            )
        bs = self.config.block_size
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need = cdiv(self.max_model_len if self.config.kv_layout == "contiguous" else total, bs)
        what = f"{len(ids)} prompt + {params.max_tokens} output tokens"
        if params.use_beam_search:
            # The beams share the prompt; each needs its own blocks for its output (+1 for a CoW copy).
            need = cdiv(len(ids), bs) + params.beam_width * (cdiv(total - len(ids), bs) + 1)
            what += f" in {params.beam_width} beams"
        if need > self.pool.num_blocks:
            raise ValueError(
                f"this request can never fit: {what} need {need} blocks of {bs}, "
                f"but the whole pool has {self.pool.num_blocks}"
            )
        return ids, text

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        client: str = "",
    ) -> str:
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
        req = Request(
            rid,
            groups.next_index(),
            ids,
            params,
            prompt=text,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            generator=make_generator(params.seed, 0),
            pending_forks=0 if beam else params.n - 1,
            client=client,
        )
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
        self.ledger.step = self.step_count
        self.request_groups.created.clear()
        touched: list[Request] = []
        sampled: dict[str, int] = {}
        error = None
        swap_outs_lost = True  # until the device work has run
        try:
            sched = self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - an engine bug must not leave requests holding blocks
            error = f"scheduling failed: {one_line(e, with_type=True)}"
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
                error = one_line(e, with_type=True)
                logger.exception("step %d failed", self.step_count)
        if error is not None:
            sampled = {}
            touched += self._fail_step(sched, error, swap_outs_lost)
            outputs = self._outputs(touched, decode=False)
        self.request_groups.sweep()
        return StepOutput(
            self.step_count, outputs, self.ledger.drain_events(), sched.num_scheduled_tokens, sampled, error
        )

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
                all(m.is_finished for m in members) and not members[0].pending_forks
            ):
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
        holding = [
            r for r in self.requests.values() if r.request_id not in queued or r.request_id in self.kv.req_to_blocks
        ]
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
                        r, f"its swap-out in step {self.step_count} never completed ({error}); recomputing"
                    )
        victims = [s.request for s in sched.scheduled] + list(self.request_groups.created)
        return self.request_groups.fail(victims, error)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
