"""vLLM's block hashes reproduced from token ids: all four of its algorithms against vLLM's own functions run in
vLLM's environment, and inside kvscope's engine with ``--hash-algo sha256_cbor``."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest
from vllm_live import need_vllm

from engine import SamplingParams
from engine.core.vllm_hashing import (
    VLLM_DEFAULT_SEED,
    VLLM_HASH_ALGOS,
    VllmBlockHasher,
    low64,
    not_reproducible,
    vllm_extra_keys,
)


def test_a_chain_hashes_full_blocks_each_on_its_parent_and_salts_only_the_first():
    h = VllmBlockHasher("sha256_cbor", "0")
    tokens = list(range(100, 171))  # 71 tokens: two full blocks of 32, a partial one
    chain = h.chain(tokens, 32)
    assert len(chain) == 2 and all(len(d) == 32 for d in chain)
    assert chain[0] == h.hash_block(None, tokens[:32]) and chain[1] == h.hash_block(chain[0], tokens[32:64])
    salted = h.chain(tokens, 32, cache_salt="tenant-a")
    assert salted[0] == h.hash_block(None, tokens[:32], (("cache_salt", "tenant-a"),)) != chain[0]
    assert vllm_extra_keys(1, "tenant-a") is None and vllm_extra_keys(0, None) is None
    assert h.none_hash != VllmBlockHasher("sha256_cbor", VLLM_DEFAULT_SEED).none_hash  # the seed is in every chain
    assert VllmBlockHasher("sha256", "0").chain(tokens, 32) != chain
    assert low64(chain[0]) == int.from_bytes(chain[0][-8:], "big")


def test_the_hashes_kvscope_cannot_compute_are_said_in_one_line():
    for algo in ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor"):
        assert not_reproducible(algo) is None  # with the instance's PYTHONHASHSEED known
    for algo in ("sha256_cbor", "sha256"):
        assert not_reproducible(algo, seed_known=False) is None  # vLLM's fixed default seed
    for algo, seed_known in (("xxhash", False), ("xxhash_cbor", False), ("md5", True)):
        why = not_reproducible(algo, seed_known)
        assert why and "\n" not in why and algo in why
    with pytest.raises(ValueError, match="md5"):
        VllmBlockHasher("md5")
    a, b = VllmBlockHasher("xxhash", "0"), VllmBlockHasher("xxhash_cbor", "0")
    assert len(a.none_hash) == len(b.none_hash) == 16 and a.chain(list(range(8)), 4) != b.chain(list(range(8)), 4)


VLLM_SCRIPT = """
import json, os, sys
import vllm.v1.core.kv_cache_utils as k
from vllm.utils.hashing import get_hash_fn_by_name
runs = json.loads(sys.stdin.read())
out = []
for seed, algo, chains in runs:
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed  # what vLLM's init_none_hash reads
    fn = get_hash_fn_by_name(algo)
    k.init_none_hash(fn)
    for tokens, bs, salt in chains:
        parent, hashes = None, []
        for i in range(len(tokens) // bs):
            extra = (("cache_salt", salt),) if i == 0 and salt else None
            parent = k.hash_block_tokens(fn, parent, tokens[i * bs:(i + 1) * bs], extra)
            hashes.append([parent.hex(), k.maybe_convert_block_hash(parent)])
        out.append(hashes)
print(json.dumps(out))
"""


def test_the_hashes_equal_vllms_own():
    """vLLM's own ``hash_block_tokens``, ``init_none_hash`` and ``maybe_convert_block_hash`` in vLLM's Python, for
    all four of its algorithms with PYTHONHASHSEED set, and for the SHA-256 ones unset too (vLLM's fixed default
    seed; unset, it seeds the xxHash ones at random)."""
    exe = need_vllm()
    rng = random.Random(0)
    chains = [
        [
            [rng.randrange(0, 200_000) for _ in range(rng.randrange(0, 200))],
            rng.choice([16, 32]),
            rng.choice([None, "salt-\u00e9"]),
        ]
        for _ in range(12)
    ]
    runs = [[seed, algo, chains] for seed in ("0", None) for algo in VLLM_HASH_ALGOS if seed or algo.startswith("sha")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    r = subprocess.run(
        [exe, "-c", VLLM_SCRIPT], input=json.dumps(runs), capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = []
    for seed, algo, cs in runs:
        h = VllmBlockHasher(algo, seed if seed is not None else VLLM_DEFAULT_SEED)
        ours += [[[d.hex(), low64(d)] for d in h.chain(tokens, bs, salt)] for tokens, bs, salt in cs]
    assert sum(len(c) for c in theirs) > 100 and ours == theirs


def test_kvscope_engine_hashes_as_vllm_with_sha256_cbor(tiny_engine, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    prompt = list(range(1, 30))
    expected = [d.hex() for d in VllmBlockHasher("sha256_cbor", "0").chain(prompt, 4)]
    for algo, same in (("sha256_cbor", True), ("sha256", False)):
        engine = tiny_engine(num_gpu_blocks=32, block_size=4, hash_algo=algo)
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        cached = {h.hex() for h in engine.pool.cached}
        assert (set(expected) <= cached) is same
