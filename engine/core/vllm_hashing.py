"""vLLM's prefix-cache block hashes, reproduced from token ids (written from vLLM 0.32's behaviour, none of its code).

A router that sends each request where its prefix is cached (llm-d's precise prefix-cache scorer, Dynamo's KV
router) must compute, from a prompt's tokens, the very hashes each vLLM instance publishes in its KV events. vLLM
chains them: block i's hash is ``H((parent, tokens_i, extra_keys))`` with ``parent`` the previous block's 32-byte
digest, or ``NONE_HASH`` for a prompt's first block, and ``H`` the ``--prefix-caching-hash-algo``:

- ``sha256_cbor``: SHA-256 of the tuple in canonical CBOR (language-neutral: what llm-d asks vLLM to use);
- ``sha256`` (vLLM's default): SHA-256 of the tuple pickled with the highest protocol (5 on Python 3.8 and later);
- ``xxhash`` and ``xxhash_cbor``: not reproduced here (a non-cryptographic hash whose seed is random per process
  unless ``PYTHONHASHSEED`` is set; the ``xxhash`` package is not a kvscope dependency).

``NONE_HASH = H(seed)``, with ``seed`` the process's ``PYTHONHASHSEED`` if set, else (vLLM 0.32, cryptographic
algorithms) the fixed string ``"vllm-none-hash"``. ``extra_keys`` is None for a plain text request; LoRA adapters,
images, prompt embeddings and a cache salt add keys (the salt only to the first block). The KV events carry the
digest's low 64 bits (``low64``) unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.

kvscope's engine hashes this way too with ``--hash-algo sha256_cbor``, so a router computes the same hashes for a
kvscope instance as for a vLLM one.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM 0.32's NONE_HASH seed for sha256 and sha256_cbor without PYTHONHASHSEED
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # vLLM's --prefix-caching-hash-algo values
REPRODUCIBLE = ("sha256_cbor", "sha256")
_LOW64 = (1 << 64) - 1


def low64(digest: bytes) -> int:
    """What vLLM's KV events carry for a digest: its low 64 bits, as an unsigned int."""
    return int.from_bytes(digest, "big") & _LOW64


def seed_from_env() -> str:
    """The NONE_HASH seed of a process started with this environment (vLLM reads ``PYTHONHASHSEED``)."""
    return os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)


def not_reproducible(algo: str) -> str | None:
    """Why kvscope cannot compute ``algo``'s hashes (one line), or None when it can."""
    if algo in REPRODUCIBLE:
        return None
    if algo in VLLM_HASH_ALGOS:
        return (
            f"vLLM's {algo} hashes cannot be reproduced here (a non-cryptographic hash, seeded at random "
            f"unless PYTHONHASHSEED is set): start vLLM with --prefix-caching-hash-algo sha256_cbor"
        )
    return f"{algo!r} is not one of vLLM's prefix-caching hash algorithms ({', '.join(VLLM_HASH_ALGOS)})"


# --- canonical CBOR (RFC 8949 section 4.2.1) for the few types a block-hash tuple holds ----------------------


def _head(major: int, n: int) -> bytes:
    """A data item's head: the major type and its argument in the shortest form (what canonical means)."""
    if n < 24:
        return bytes((major << 5 | n,))
    for info, fmt, limit in ((24, ">B", 1 << 8), (25, ">H", 1 << 16), (26, ">I", 1 << 32), (27, ">Q", 1 << 64)):
        if n < limit:
            return bytes((major << 5 | info,)) + struct.pack(fmt, n)
    raise ValueError(f"{n} does not fit a CBOR head (a token id or length beyond 64 bits)")


def cbor_canonical(obj: Any) -> bytes:
    """``cbor2.dumps(obj, canonical=True)`` for None, bools, ints within 64 bits, bytes, str, tuples and lists.

    Hand-written (kvscope has no CBOR dependency) for exactly what vLLM's block-hash tuples contain; anything else
    is refused rather than encoded differently from cbor2.
    """
    out: list[bytes] = []

    def enc(o: Any) -> None:
        if o is None:
            out.append(b"\xf6")
        elif o is True or o is False:
            out.append(b"\xf5" if o else b"\xf4")
        elif isinstance(o, int):
            out.append(_head(0, o) if o >= 0 else _head(1, -1 - o))
        elif isinstance(o, bytes):
            out.append(_head(2, len(o)))
            out.append(o)
        elif isinstance(o, str):
            raw = o.encode("utf-8")
            out.append(_head(3, len(raw)))
            out.append(raw)
        elif isinstance(o, (tuple, list)):
            out.append(_head(4, len(o)))
            for item in o:
                enc(item)
        else:
            raise TypeError(f"cannot encode {type(o).__name__} as a block-hash key")

    enc(obj)
    return b"".join(out)


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor_canonical(obj)).digest()


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


_HASH_FNS = {"sha256_cbor": _sha256_cbor, "sha256": _sha256_pickle}


def vllm_extra_keys(block_index: int, cache_salt: str | None) -> tuple | None:
    """A text request's extra keys for block ``block_index``: the cache salt on the first block, else none."""
    return (("cache_salt", cache_salt),) if block_index == 0 and cache_salt else None


@dataclass(frozen=True)
class VllmBlockHasher:
    """One vLLM instance's hashing: its algorithm and its NONE_HASH seed (its ``PYTHONHASHSEED``)."""

    algo: str = "sha256_cbor"
    seed: str = VLLM_DEFAULT_SEED
    none_hash: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        why = not_reproducible(self.algo)
        if why:
            raise ValueError(why)
        object.__setattr__(self, "none_hash", _HASH_FNS[self.algo](self.seed))

    def hash_block(self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        """One full block's 32-byte digest, chained on ``parent`` (None: a prompt's first block)."""
        return _HASH_FNS[self.algo]((parent or self.none_hash, tuple(token_ids), extra_keys))

    def chain(self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
        """The digests of every full block of ``token_ids``, in order (a partial last block has none)."""
        out: list[bytes] = []
        parent = None
        for i in range(len(token_ids) // block_size):
            parent = self.hash_block(
                parent, token_ids[i * block_size : (i + 1) * block_size], vllm_extra_keys(i, cache_salt)
            )
            out.append(parent)
        return out

    def describe(self) -> str:
        return f"{self.algo}, seed {self.seed!r}"
