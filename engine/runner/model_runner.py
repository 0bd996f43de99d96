"""Owns the model and the KV tensors; turns a scheduled step into sampled tokens."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ..config import EngineConfig
from ..core.kv_cache_manager import cdiv
from ..core.scheduler import SchedulerOutput
from .attention import cpu_attention, torch_ref
from .attention.metadata import AttentionMetadata, sampled_rows
from .block_copy import swap_blocks
from .cpu_linear import pack_linears
from .cuda_graphs import DecodeGraphs, capture_sizes
from .fused import LayerOps, fused_ops_for
from .kv_quant import QuantizedKV, copy_blocks, part_formats, token_bytes
from .memory import GiB, KVPoolPlan, weights_bytes, zeros
from .models.llama import LlamaForCausalLM
from .page_populate import PagePopulator
from .sampler import sample

logger = logging.getLogger("engine")


class DeviceCopyError(RuntimeError):
    """A swap-out, swap-in or copy-on-write copy failed; ``kind`` says which."""

    def __init__(self, kind: str, cause: BaseException) -> None:
        super().__init__(f"{kind} copy failed: {type(cause).__name__}: {cause}")
        self.kind = kind


def _tensors_of(cache: torch.Tensor | QuantizedKV) -> list[torch.Tensor]:
    """One layer's K or V pool as tensors (a quantized pool's codes and scales)."""
    return [cache] if isinstance(cache, torch.Tensor) else cache.block_tensors()


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_model,
        device: torch.device,
        max_model_len: int,
        model: LlamaForCausalLM | None = None,
    ) -> None:
        """``model``: built already (the engine's loads); else it is read from ``hf_model``, left untouched."""
        self.config = config
        # Called with (request id, block id) for every block a step writes, before the forward
        # (the engine's write audit: no write into a shared or published block).
        self.write_observer: Callable[[list[tuple[str, int]]], None] | None = None
        self.device = device
        self.model = model if model is not None else LlamaForCausalLM.from_hf(hf_model)
        if device.type == "cpu":
            pack_linears(self.model)  # oneDNN's layout, once: the CPU's matmuls ~1.5x faster
        self.dtype = self.model.embed_tokens.weight.dtype
        self.vocab_size = self.model.lm_head.weight.shape[0]
        self.max_model_len = max_model_len
        self.kv_dtype = self.dtype  # what attention reads: a quantized pool dequantizes to it
        self.kv_formats = part_formats(config.kv_cache_dtype)
        self.block_size = config.block_size
        self.attention, self.store, self.backend = self._select_backend()
        self.ops = self._select_ops()
        self.fp8_scales = self._calibrate_fp8() if "fp8" in self.kv_formats else None
        self.pool_plan: KVPoolPlan | None = None  # how the pool was sized on CUDA (gpu_memory_utilization)
        self.num_blocks = self._num_blocks()
        # zeros() on the CPU maps pages lazily: a 2 GiB pool costs nothing until used.
        self.kv_caches = [self._new_cache(self.num_blocks, i, device) for i in range(self.model.num_layers)]
        # ...and a first write into a lazy page stalls a step (page_populate.py): the pages of the blocks a step may
        # write next are made resident ahead of it, on a thread of its own
        self.populator = (
            PagePopulator(
                [t for pair in self.kv_caches for c in pair for t in _tensors_of(c)],
                self.num_blocks,
                cdiv(config.max_num_batched_tokens, self.block_size) + config.max_num_seqs,
            )
            if device.type == "cpu"
            else None
        )
        self.default_generator = torch.Generator(device=device).manual_seed(config.seed)
        self.decode_graphs: DecodeGraphs | None = None
        if device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs()
        # --swap-space's bytes, but never more blocks than every sequence at full length could swap out: 4 GiB
        # over a small model's 3 KiB blocks would be 1.4 M blocks nobody can fill (and pinned memory on CUDA)
        self.num_cpu_blocks = (
            config.num_cpu_blocks
            if config.num_cpu_blocks is not None
            else min(
                int(config.swap_space * 2**30) // self.block_bytes,
                config.max_num_seqs * cdiv(max_model_len, self.block_size),
            )
        )
        if config.preemption_mode != "swap":
            self.num_cpu_blocks = 0
        # Pinned host memory makes the device<->host copies asynchronous on CUDA.
        pin = device.type == "cuda"
        self.cpu_caches = (
            [self._new_cache(self.num_cpu_blocks, i, torch.device("cpu"), pin) for i in range(self.model.num_layers)]
            if self.num_cpu_blocks
            else []
        )
        if self.num_cpu_blocks:
            logger.info(
                "CPU swap pool: %d blocks, %.3f GiB",
                self.num_cpu_blocks,
                self.num_cpu_blocks * self.block_bytes / 2**30,
            )

    # -- sizing --------------------------------------------------------------------
    def _new_cache(self, num_blocks: int, layer: int, device: torch.device, pin: bool = False):
        """One layer's (K, V) pools in the configured formats."""
        m = self.model
        out: list[torch.Tensor | QuantizedKV] = []
        for part, fmt in enumerate(self.kv_formats):
            if fmt == "none":
                out.append(zeros((num_blocks, self.block_size, m.num_kv_heads, m.head_dim), self.kv_dtype, device, pin))
            else:
                scale = self.fp8_scales[layer][part] if fmt == "fp8" and self.fp8_scales is not None else None
                out.append(
                    QuantizedKV(
                        fmt, num_blocks, self.block_size, m.num_kv_heads, m.head_dim, self.kv_dtype, device, pin, scale
                    )
                )
        return tuple(out)

    @functools.cached_property
    def block_bytes(self) -> int:
        """K + V bytes of one block over all layers, scales included (fixed once the pool is built)."""
        m = self.model
        per_token = sum(token_bytes(f, m.num_kv_heads, m.head_dim, dtype_size(self.kv_dtype)) for f in self.kv_formats)
        return m.num_layers * per_token * self.block_size

    @staticmethod
    def _fp8_scale(amax: torch.Tensor, headroom: float) -> torch.Tensor:
        """A head's scale: its largest magnitude (times the headroom) at fp8 e4m3's largest value, 448."""
        return (amax * headroom / 448.0).clamp_min(1e-6).cpu()

    @torch.inference_mode()
    def _calibrate_fp8(self, num_tokens: int = 256, headroom: float = 2.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """fp8 scales per layer and KV head: amax over a calibration forward x headroom / 448.

        A forward over random tokens sees K/V of the magnitudes real text produces (both come
        out of an RMS-normalised projection); values past the headroom saturate at +-448 x scale.
        """
        m = self.model
        n = min(num_tokens, self.max_model_len)
        g = torch.Generator().manual_seed(self.config.seed)
        ids = torch.randint(0, self.vocab_size, (n,), generator=g).to(self.device)
        pos = torch.arange(n, device=self.device)
        bs = self.block_size
        nb = cdiv(n, bs)
        shape = (nb, bs, m.num_kv_heads, m.head_dim)
        caches = [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
            for _ in range(m.num_layers)
        ]
        amax: list[tuple[torch.Tensor, torch.Tensor]] = []

        def record(key, value, k_cache, v_cache, slot_mapping):
            amax.append((key.float().abs().amax(dim=(0, 2)), value.float().abs().amax(dim=(0, 2))))
            torch_ref.store_kv(key, value, k_cache, v_cache, slot_mapping)

        meta = self._metadata_for([(0, n, list(range(nb)))], pos)
        m(ids, pos, caches, meta, torch_ref.paged_attention, record)
        scales = [(self._fp8_scale(k, headroom), self._fp8_scale(v, headroom)) for k, v in amax]
        logger.info(
            "fp8 KV scales calibrated over %d tokens (x%.0f headroom): K %.3g..%.3g, V %.3g..%.3g",
            n,
            headroom,
            min(float(k.min()) for k, _ in scales),
            max(float(k.max()) for k, _ in scales),
            min(float(v.min()) for _, v in scales),
            max(float(v.max()) for _, v in scales),
        )
        return scales

    def _num_blocks(self) -> int:
        c = self.config
        if c.num_gpu_blocks is not None:
            n, why = c.num_gpu_blocks, "--num-gpu-blocks"
        elif c.kv_cache_memory_bytes is not None:
            n, why = c.kv_cache_memory_bytes // self.block_bytes, f"kv_cache_memory_bytes={c.kv_cache_memory_bytes}"
        elif self.device.type == "cuda":
            plan = self.pool_plan = self._profile_cuda()
            logger.info("%s", plan.describe())
            plan.check()
            n, why = plan.num_blocks, f"gpu_memory_utilization={c.gpu_memory_utilization}"
        else:
            # Enough for every sequence at full length, but never more than the CPU budget.
            want = c.max_num_seqs * cdiv(self.max_model_len, self.block_size)
            n = min(want, c.cpu_kv_cache_bytes // self.block_bytes)
            why = f"CPU default (at most {c.cpu_kv_cache_bytes / GiB:.1f} GiB)"
        if n < 1:
            raise ValueError(f"the KV pool would hold 0 blocks ({why}, block bytes {self.block_bytes})")
        logger.info(
            "weights %.2f GiB; KV pool: %d blocks x %d tokens = %d tokens, %.3f GiB (%s); "
            "maximum concurrency at %d tokens: %.2fx",
            weights_bytes(self.model) / GiB,
            n,
            self.block_size,
            n * self.block_size,
            n * self.block_bytes / GiB,
            why,
            self.max_model_len,
            n * self.block_size / self.max_model_len,
        )
        return n

    def _profile_cuda(self) -> KVPoolPlan:
        """vLLM's rule: run a forward at the step's token budget and measure the activation peak."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        base = torch.cuda.memory_allocated(self.device)
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        dummy_shape = (cdiv(n, self.block_size) + 1, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        kc = torch.zeros(dummy_shape, dtype=self.kv_dtype, device=self.device)
        caches = [(kc, kc)] * self.model.num_layers
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        meta = self._metadata_for([(0, n, list(range(dummy_shape[0])))], pos)
        h = self.model(ids, pos, caches, meta, self.attention, self.store, self.ops)
        self.model.compute_logits(h[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del h
        graph_bytes = self._profile_graph_memory(caches) if self._will_capture_graphs() else 0
        del kc, caches
        torch.cuda.empty_cache()
        weights = weights_bytes(self.model)
        return KVPoolPlan(
            total,
            weights,
            peak,
            max(0, total - free - base),
            self.config.gpu_memory_utilization,
            self.block_bytes,
            self.block_size,
            self.max_model_len,
            held_bytes=max(0, base - weights),
            graph_bytes=graph_bytes,
        )

    def _will_capture_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager and self.backend == "triton"

    def _profile_graph_memory(self, caches) -> int:
        """The decode graphs' pool keeps the largest captured batch's activations and logits for good:
        an eager forward of that batch (one token per sequence) measures them."""
        b = capture_sizes(self.config.max_num_seqs)[-1]
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(b, dtype=torch.long, device=self.device)
        pos = torch.zeros(b, dtype=torch.long, device=self.device)
        meta = self._metadata_for([(0, 1, [0])] * b, pos)
        logits = self.model.compute_logits(self.model(ids, pos, caches, meta, self.attention, self.store, self.ops))
        torch.cuda.synchronize(self.device)
        del logits
        return max(0, torch.cuda.max_memory_allocated(self.device) - base)

    def _capture_graphs(self) -> None:
        if self.backend != "triton":
            logger.info("no CUDA graphs: the %s attention backend syncs with the host", self.backend)
            return
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.attention,
            self.store,
            self.device,
            self.config.max_num_seqs,
            cdiv(self.max_model_len, self.block_size),
            self.block_size,
            ops=self.ops,
        )
        try:
            graphs.capture()
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: fall back to eager
            logger.warning("CUDA graph capture failed (%s: %s); running decode eagerly", type(e).__name__, e)
            torch.cuda.synchronize(self.device)
            return
        self.decode_graphs = graphs

    def _select_ops(self) -> LayerOps | None:
        """The fused kernels (``fuse_ops``) of the Triton and the CPU backends, where the model allows them."""
        if self.backend not in ("triton", "cpu") or not self.config.fuse_ops:
            return None
        ops, why = fused_ops_for(self.model, self.max_model_len, self.backend, self.config.kv_cache_dtype)
        if ops is None:
            logger.info("no fused kernels: %s", why)
        return ops

    def _select_backend(self):
        backend = self.config.attention_backend
        if backend == "auto":
            if self.device.type == "cpu":
                backend = "cpu"
            else:
                backend = "triton" if self.device.type == "cuda" and _triton_available() else "torch"
        if backend == "cpu":
            if self.device.type != "cpu":
                raise ValueError("attention_backend='cpu' runs on the CPU; use 'triton' or 'torch' on CUDA")
            # decode from the C kernel (torch_ref's ops where it cannot be built), prefill and the store torch_ref's
            return cpu_attention.paged_attention, torch_ref.store_kv, "cpu"
        if backend == "triton":
            try:
                from .attention import triton_paged
            except ImportError as e:
                raise ValueError(
                    f"attention_backend='triton' needs the triton package ({e}); "
                    "pip install triton, or use attention_backend='torch'"
                ) from e
            if self.device.type != "cuda" and not triton_paged.interpreted():
                raise ValueError(
                    "attention_backend='triton' runs on CUDA (on the CPU only under the Triton "
                    "interpreter, TRITON_INTERPRET=1, which is for tests); use attention_backend='torch'"
                )
            return triton_paged.paged_attention, triton_paged.store_kv, "triton"
        return torch_ref.paged_attention, torch_ref.store_kv, "torch"

    # -- one step --------------------------------------------------------------------
    def _metadata_for(
        self, seqs: list[tuple[int, int, list[int]]], positions: torch.Tensor, shifted: frozenset[int] = frozenset()
    ) -> AttentionMetadata:
        """``seqs``: (num_computed_tokens, num_new_tokens, block_ids) for each sequence; the slots of the
        sequences in ``shifted`` are one too early (the ``shared-write`` fault)."""
        bs = self.block_size
        qsl, seq_lens, slots = [0], [], []
        for i, (computed, new, block_ids) in enumerate(seqs):
            qsl.append(qsl[-1] + new)
            seq_lens.append(computed + new)
            shift = 1 if i in shifted else 0
            for p in range(computed - shift, computed + new - shift):
                slots.append(block_ids[p // bs] * bs + p % bs)
        max_blocks = max(len(b) for _, _, b in seqs)
        tables = torch.tensor([b + [0] * (max_blocks - len(b)) for _, _, b in seqs], dtype=torch.long)
        decode = [i for i, (_, new, _) in enumerate(seqs) if new == 1]
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long).to(dev),
            query_start_loc=qsl,
            seq_lens_host=seq_lens,
            block_size=bs,
            decode_seqs=torch.tensor(decode, dtype=torch.long).to(dev),
            decode_tokens=torch.tensor([qsl[i] for i in decode], dtype=torch.long).to(dev),
            prefill_seqs=[i for i, (_, new, _) in enumerate(seqs) if new != 1],
        )

    def apply_device_work(self, sched: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write copies: all before the forward writes any KV.

        A failing copy raises ``DeviceCopyError`` naming its kind, so the engine knows whose
        KV never arrived (a swap-out's requests recompute; the step's requests fail).
        """
        for kind, pairs, copy in (
            ("swap-out", sched.swap_out, self.swap_out_blocks),
            ("swap-in", sched.swap_in, self.swap_in_blocks),
            ("copy-on-write", sched.copies, self.copy_on_write),
        ):
            if not pairs:
                continue
            try:
                copy(pairs)
            except Exception as e:  # noqa: BLE001 - re-raised with what it was moving
                raise DeviceCopyError(kind, e) from e

    @torch.inference_mode()
    def swap_out_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs: device -> CPU."""
        self._swap(pairs, to_cpu=True)

    @torch.inference_mode()
    def swap_in_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs: CPU -> device."""
        self._swap(pairs, to_cpu=False)

    def _swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        swap_blocks(self.kv_caches, self.cpu_caches, pairs, to_cpu)

    @torch.inference_mode()
    def copy_on_write(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device block pairs: the filled slots of a shared block, before a sequence writes."""
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
        for pair in self.kv_caches:
            for cache in pair:
                copy_blocks(cache, dst, cache, src)

    def execute(self, sched: SchedulerOutput) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        """Run one forward over every scheduled token; sample where a request reached its end.

        Returns the sampled tokens, and the logits rows of requests about to fork (n > 1),
        so that each new sample draws its first token from the same distribution, and of
        beams (beam search picks their tokens itself).
        """
        seqs: list[tuple[int, int, list[int]]] = []
        ids: list[int] = []
        pos: list[int] = []
        for s in sched.scheduled:
            c, n = s.num_computed_tokens, s.num_new_tokens
            seqs.append((c, n, s.block_ids))
            ids.extend(s.request.token_slice(c, c + n))
            pos.extend(range(c, c + n))
        populator = self.populator
        if populator is not None:
            if populator.done:
                self.populator = None
            else:
                populator.note(max((b[-1] for _, _, b in seqs if b), default=-1))
        shifted = self._shared_write_fault(sched) if self.config.fault == "shared-write" else frozenset()
        if self.write_observer is not None:
            self.write_observer(self._written_blocks(sched, seqs, shifted))
        graphs = self.decode_graphs
        if (
            graphs is not None
            and not shifted
            and len(seqs) == len(ids) <= graphs.max_batch
            and all(s.samples for s in sched.scheduled)
        ):
            # A decode-only step: the whole step's device work is one graph replay (logits included).
            bs = self.block_size
            slots = [b[p // bs] * bs + p % bs for (p, _, b) in seqs]
            logits = graphs.run(ids, pos, slots, [b for _, _, b in seqs])
            reqs = [s.request for s in sched.scheduled]
            return self._sampled(logits, reqs)
        positions = torch.tensor(pos, dtype=torch.long).to(self.device)
        meta = self._metadata_for(seqs, positions, shifted)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device)
        rows = [i for i, s in enumerate(sched.scheduled) if s.samples]
        # the last layer past its K/V store on the sampling rows only (SampledRows): a prefill's other rows feed
        # no later layer and no logits
        sampled = sampled_rows(meta, rows)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.attention, self.store, self.ops, sampled)
        if not rows:
            return {}, {}
        logits = self.model.compute_logits(hidden)
        return self._sampled(logits, [sched.scheduled[i].request for i in rows])

    def _sampled(self, logits: torch.Tensor, reqs: list) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        tokens = self.sample(logits, reqs)
        forking = {
            r.request_id: logits[j].cpu()
            for j, r in enumerate(reqs)
            if r.pending_forks or r.sampling_params.use_beam_search
        }
        return {r.request_id: t for r, t in zip(reqs, tokens)}, forking

    def _shared_write_fault(self, sched: SchedulerOutput) -> frozenset[int]:
        """The fault: a request's first chunk after a prefix hit that ends on a block boundary."""
        return frozenset(
            i
            for i, s in enumerate(sched.scheduled)
            if s.num_computed_tokens > 0
            and s.num_computed_tokens == s.request.num_cached_tokens
            and s.num_computed_tokens % self.block_size == 0
        )

    def _written_blocks(self, sched: SchedulerOutput, seqs, shifted: frozenset[int]) -> list[tuple[str, int]]:
        """(request id, physical block) for every block this step's slot mapping writes into."""
        bs = self.block_size
        out: list[tuple[str, int]] = []
        for i, (computed, new, block_ids) in enumerate(seqs):
            shift = 1 if i in shifted else 0
            first, last = (computed - shift) // bs, (computed + new - 1 - shift) // bs
            rid = sched.scheduled[i].request.request_id
            out.extend((rid, block_ids[j]) for j in range(first, last + 1))
        return out

    def sample(self, logits: torch.Tensor, reqs: list) -> list[int]:
        """The sampler (``sampler.sample``) over one row per request; tests replace it to force failures."""
        return sample(logits, [r.sampling_params for r in reqs], [r.generator or self.default_generator for r in reqs])


def _triton_available() -> bool:
    try:
        from .attention import triton_paged  # noqa: F401
    except ImportError:
        return False
    return True
