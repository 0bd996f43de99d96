"""vLLM's prefix-cache block hashes, reproduced from token ids (written from vLLM 0.32's behaviour, none of its code).

A router that sends each request where its prefix is cached (llm-d's precise prefix-cache scorer, Dynamo's KV
router) must compute, from a prompt's tokens, the very hashes each vLLM instance publishes in its KV events. vLLM
chains them: block i's hash is ``H((parent, tokens_i, extra_keys))`` with ``parent`` the previous block's digest,
or ``NONE_HASH`` for a prompt's first block, and ``H`` the ``--prefix-caching-hash-algo``, each computed with the
library vLLM itself calls (``cbor2``, ``hashlib``, ``pickle``, ``xxhash``):

- ``sha256_cbor``: SHA-256 of the tuple in canonical CBOR (language-neutral: what llm-d asks vLLM to use);
- ``sha256`` (vLLM's default): SHA-256 of the tuple pickled with the highest protocol (5 on Python 3.8 and later);
- ``xxhash_cbor`` and ``xxhash``: xxHash3-128 of the same bytes (fast, not collision resistant).

``NONE_HASH = H(seed)``, with ``seed`` the process's ``PYTHONHASHSEED`` if set, else the fixed string
``"vllm-none-hash"`` for the SHA-256 algorithms and random bytes for the xxHash ones (so an xxHash instance's hashes
can be reproduced only when its ``PYTHONHASHSEED`` is known). ``extra_keys`` is None for a plain text request; LoRA
adapters, images, prompt embeddings and a cache salt add keys (the salt only to the first block). The KV events
carry the digest's low 64 bits (``low64``) unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.

kvscope's engine hashes this way too with ``--hash-algo sha256_cbor``, so a router computes the same hashes for a
kvscope instance as for a vLLM one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import xxhash

VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM 0.32's NONE_HASH seed for sha256 and sha256_cbor without PYTHONHASHSEED
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # vLLM's --prefix-caching-hash-algo values
SEEDED_AT_RANDOM = ("xxhash", "xxhash_cbor")  # without PYTHONHASHSEED, vLLM seeds these from os.urandom
REPRODUCIBLE = ("sha256_cbor", "sha256")  # whatever the seed: what "auto" tries when no seed was given
_LOW64 = (1 << 64) - 1


def low64(digest: bytes) -> int:
    """What vLLM's KV events carry for a digest: its low 64 bits, as an unsigned int."""
    return int.from_bytes(digest, "big") & _LOW64


def seed_from_env() -> str:
    """The NONE_HASH seed of a process started with this environment (vLLM reads ``PYTHONHASHSEED``)."""
    return os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)


def not_reproducible(algo: str, seed_known: bool = True) -> str | None:
    """Why kvscope cannot compute ``algo``'s hashes (one line), or None when it can. ``seed_known``: the
    instance's ``PYTHONHASHSEED`` was given (an xxHash instance started without one seeds itself at random)."""
    if algo not in VLLM_HASH_ALGOS:
        return f"{algo!r} is not one of vLLM's prefix-caching hash algorithms ({', '.join(VLLM_HASH_ALGOS)})"
    if algo in SEEDED_AT_RANDOM and not seed_known:
        return (
            f"vLLM's {algo} hashes cannot be reproduced without its PYTHONHASHSEED (without one, vLLM seeds "
            f"{algo} at random): give its hash_seed, or start vLLM with --prefix-caching-hash-algo sha256_cbor"
        )
    return None


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# each algorithm: how the tuple becomes bytes, then the digest of them (vLLM's pairs)
_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda obj: _sha256(_pickle(obj)),
    "sha256_cbor": lambda obj: _sha256(_cbor(obj)),
    "xxhash": lambda obj: xxhash.xxh3_128_digest(_pickle(obj)),
    "xxhash_cbor": lambda obj: xxhash.xxh3_128_digest(_cbor(obj)),
}


@functools.lru_cache(maxsize=64)
def _none_hash(algo: str, seed: str) -> bytes:
    return _HASH_FNS[algo](seed)


def vllm_extra_keys(block_index: int, cache_salt: str | None) -> tuple | None:
    """A text request's extra keys for block ``block_index``: the cache salt on the first block, else none."""
    return (("cache_salt", cache_salt),) if block_index == 0 and cache_salt else None


@dataclass(frozen=True)
class VllmBlockHasher:
    """One vLLM instance's hashing: its algorithm and its NONE_HASH seed (its ``PYTHONHASHSEED``; an xxHash
    instance's must be the one it was started with)."""

    algo: str = "sha256_cbor"
    seed: str = VLLM_DEFAULT_SEED

    def __post_init__(self) -> None:
        why = not_reproducible(self.algo)
        if why:
            raise ValueError(why)

    @property
    def none_hash(self) -> bytes:
        """The parent of a prompt's first block: ``H(seed)``."""
        return _none_hash(self.algo, self.seed)

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
