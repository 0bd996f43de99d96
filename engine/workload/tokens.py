"""Prompt token ids made from Mooncake's hash ids, so the engine's own chained hashing sees exactly
the trace's sharing.

The construction: hash id ``h`` stands for the 512 tokens

    [h % V, h // V] + R[o : o + 510],   o = (h * 7919) % L

where ``V`` is the simulated model's vocabulary and ``R`` is a fixed pseudo-random row of ``L + 510``
token ids (seeded, so every run and every machine makes the same tokens). A request's prompt is
its ids' tokens one after another, cut at its ``input_length`` (a last, partial block is the start
of its id's 512 tokens).

- Same id, same tokens: they are a function of ``h`` alone.
- Different ids never collide: the first two tokens are the digits of ``h`` in base ``V``, so two
  ids below ``V**2`` always differ in them (``V = 32,000`` allows over a billion ids; Mooncake's
  traces use under 200,000). Once two prompts differ in a block, every later block's chained hash
  differs too, so a hit is exactly a prefix of equal hash ids.
- Any engine block size that divides 512 keeps the rule, as long as a block holds both digits:
  block size >= 2, or any block size when every id is below ``V`` (then ``h // V`` is 0 and the
  first token alone tells the ids apart). ``check_block_size`` says so when a block size cannot.

Token ids are Python ints shared from one table of ``V`` ints, and a prompt is built by list
slices: the cached blocks keep tuples of these ints, and a private int per token would cost 32
bytes each (3 GB for a 100-million-token cache).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .reader import MOONCAKE_BLOCK, WorkloadError

_ROW = 4093  # L: a prime, so offsets spread over the row
_SEED = 512


class HashIdTokens:
    def __init__(self, vocab_size: int, hash_block_size: int = MOONCAKE_BLOCK) -> None:
        if vocab_size < 2:
            raise ValueError(f"the vocabulary must have at least 2 tokens, got {vocab_size}")
        if hash_block_size < 2:
            raise ValueError(f"a hash block must hold at least 2 tokens (the id's digits), got {hash_block_size}")
        self.vocab_size = vocab_size
        self.hash_block_size = hash_block_size
        self.max_id = vocab_size * vocab_size - 1
        self._ints = list(range(vocab_size))  # every token id as one shared int object
        rng = random.Random(_SEED)
        row = [self._ints[rng.randrange(vocab_size)] for _ in range(_ROW)]
        self._row = row + row[:hash_block_size]  # R: any offset < L has hash_block_size - 2 tokens after it

    def block(self, h: int) -> list[int]:
        """The ``hash_block_size`` tokens of hash id ``h``."""
        if not 0 <= h <= self.max_id:
            raise ValueError(f"hash id {h} is outside 0..{self.max_id} (vocabulary {self.vocab_size} squared)")
        o = (h * 7919) % _ROW
        return [self._ints[h % self.vocab_size], self._ints[h // self.vocab_size]] + self._row[
            o : o + self.hash_block_size - 2
        ]

    def prompt(self, hash_ids: Sequence[int], length: int) -> list[int]:
        """The prompt of a request with these ids and ``length`` tokens (at most len(ids) x 512)."""
        ints, row, v, n = self._ints, self._row, self.vocab_size, self.hash_block_size - 2
        out: list[int] = []
        for h in hash_ids:
            o = (h * 7919) % _ROW
            out.append(ints[h % v])
            out.append(ints[h // v])  # IndexError for an id >= V**2: check_ids says so first
            out += row[o : o + n]
        del out[length:]
        return out

    def min_block_size(self, max_id: int) -> int:
        """The smallest engine block size that keeps different ids apart, for ids up to ``max_id``."""
        return 1 if max_id < self.vocab_size else 2

    def check_block_size(self, block_size: int, max_id: int, where: str) -> None:
        """Refuse (``WorkloadError``, naming ``where``) a block size that cannot keep the trace's ids apart."""
        if self.hash_block_size % block_size:
            divisors = [d for d in range(1, self.hash_block_size + 1) if self.hash_block_size % d == 0]
            raise WorkloadError(
                f"{where}: block size {block_size} does not divide the trace's {self.hash_block_size}"
                f"-token blocks (use one of {', '.join(map(str, divisors))})"
            )
        if max_id > self.max_id:
            raise WorkloadError(
                f"{where}: hash id {max_id} is too large: ids are made into tokens as two digits "
                f"in base {self.vocab_size} (the simulated model's vocabulary), so at most "
                f"{self.max_id}"
            )
        least = self.min_block_size(max_id)
        if block_size < least:
            raise WorkloadError(
                f"{where}: block size {block_size} is too small for hash ids up to {max_id}: an id "
                f"is told apart by its first {least} tokens (ids beyond the vocabulary of "
                f"{self.vocab_size} need 2), so use --block-size {least} or more"
            )
