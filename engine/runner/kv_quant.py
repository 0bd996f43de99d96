"""Quantized KV pools: fp8 (e4m3, a static scale per KV head), int8 (a scale per token and head),
int4 for V with int8 K (keys need more precision than values).

A ``QuantizedKV`` stands in for one layer's K or V tensor: ``store`` quantizes the step's
tokens into their slots, and indexing it by block ids returns those blocks dequantized, so
``torch_ref`` reads it like a plain cache. Rounding is ``floor(x / scale + 0.5)`` with the scale
rounded to fp16 first, in the Triton store kernel too, so both paths write the same bytes.
"""

from __future__ import annotations

import torch

from .memory import zeros

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP16_TINY = 6.2e-5  # scales stay normal fp16 numbers (an all-zero row must not divide by 0)
QUANT_MODES = {"none": 0, "fp8": 1, "int8": 2, "int4": 3}  # the kernels' constexpr codes


def part_formats(kv_cache_dtype: str) -> tuple[str, str]:
    """The (K, V) storage formats of a ``kv_cache_dtype``."""
    return {"auto": ("none", "none"), "fp8": ("fp8", "fp8"), "int8": ("int8", "int8"), "int4": ("int8", "int4")}[
        kv_cache_dtype
    ]


def token_bytes(fmt: str, num_kv_heads: int, head_dim: int, elem_size: int) -> int:
    """Bytes one token takes in one layer's K or V pool, scales included."""
    per_head = {"none": head_dim * elem_size, "fp8": head_dim, "int8": head_dim + 2, "int4": head_dim // 2 + 2}[fmt]
    return num_kv_heads * per_head


class QuantizedKV:
    def __init__(
        self,
        fmt: str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        out_dtype: torch.dtype,
        device: torch.device | str,
        pin: bool = False,
        head_scale: torch.Tensor | None = None,
    ) -> None:
        if fmt == "int4" and head_dim % 2:
            raise ValueError(f"int4 packs two values a byte: head_dim must be even, got {head_dim}")
        self.fmt = fmt
        self.out_dtype = out_dtype
        self.head_dim = head_dim
        shape = (num_blocks, block_size, num_kv_heads)
        if fmt == "fp8":
            self.data = zeros((*shape, head_dim), torch.float8_e4m3fn, device, pin)
            hs = head_scale if head_scale is not None else torch.ones(num_kv_heads)
            self.scale = hs.to(device=device, dtype=torch.float32).contiguous()
        elif fmt == "int8":
            self.data = zeros((*shape, head_dim), torch.int8, device, pin)
            self.scale = zeros(shape, torch.float16, device, pin)
        elif fmt == "int4":
            self.data = zeros((*shape, head_dim // 2), torch.uint8, device, pin)
            self.scale = zeros(shape, torch.float16, device, pin)
        else:
            raise ValueError(f"unknown KV format {fmt!r}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        n, bs, h = self.data.shape[:3]
        return (n, bs, h, self.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    # -- writing ------------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x``: ``[T, kvh, D]`` -> (data rows, per-token scales or None for fp8)."""
        x = x.float()
        if self.fmt == "fp8":
            return (x / self.scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), None
        qmax = 127.0 if self.fmt == "int8" else 7.0
        scale = (x.abs().amax(-1) / qmax).clamp_min(FP16_TINY).to(torch.float16)
        q = torch.floor(x / scale.float()[..., None] + 0.5).clamp(-qmax, qmax)
        if self.fmt == "int8":
            return q.to(torch.int8), scale
        u = (q + 8).to(torch.uint8)  # 1..15: offset binary, two per byte (even d low, odd d high)
        return u[..., 0::2] | (u[..., 1::2] << 4), scale

    def store(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            x, slot_mapping = x[valid], slot_mapping[valid]
        data, scale = self.quantize(x)
        self._raw().view(-1, *self.data.shape[2:]).index_copy_(0, slot_mapping, _raw(data))
        if scale is not None:
            self.scale.view(-1, self.scale.shape[-1]).index_copy_(0, slot_mapping, scale)

    # -- reading ------------------------------------------------------------------
    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if self.fmt == "fp8":
            return (data.float() * self.scale[:, None]).to(self.out_dtype)
        assert scale is not None  # int8 and int4 keep a scale per slot (fp8's is the layer's, above)
        if self.fmt == "int8":
            vals = data.float()
        else:
            lo, hi = (data & 0xF).float() - 8, (data >> 4).float() - 8
            vals = torch.stack((lo, hi), dim=-1).flatten(-2)
        return (vals * scale.float()[..., None]).to(self.out_dtype)

    def __getitem__(self, idx) -> torch.Tensor:
        """Blocks by id, dequantized: ``cache[block_ids]`` -> ``[..., bs, kvh, D]``."""
        data = self._raw()[idx]
        if self.fmt == "fp8":
            data = data.view(torch.float8_e4m3fn)
        return self.dequantize(data, None if self.fmt == "fp8" else self.scale[idx])

    def _raw(self) -> torch.Tensor:
        """The data as bytes: CPU kernels (index_copy, gathers) do not all take float8."""
        return _raw(self.data)

    def block_tensors(self) -> list[torch.Tensor]:
        """The tensors indexed by block id: the codes, and the scales where they are per token (fp8's is per head)."""
        return [self.data] if self.fmt == "fp8" else [self.data, self.scale]

    # -- block copies (copy-on-write, swap) ---------------------------------------------
    def copy_blocks(self, dst: torch.Tensor, src_cache: QuantizedKV, src: torch.Tensor) -> None:
        to, frm = dst.to(self.data.device), src.to(src_cache.data.device)
        for mine, theirs in zip(self.block_tensors(), src_cache.block_tensors()):
            _raw(mine)[to] = _raw(theirs)[frm].to(self.data.device)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def copy_blocks(dst_cache, dst: torch.Tensor, src_cache, src: torch.Tensor) -> None:
    """Copy whole blocks between pools (device or CPU), plain tensors or quantized."""
    if isinstance(dst_cache, QuantizedKV):
        dst_cache.copy_blocks(dst, src_cache, src)
    else:
        dst_cache[dst.to(dst_cache.device)] = src_cache[src.to(src_cache.device)].to(dst_cache.device)
