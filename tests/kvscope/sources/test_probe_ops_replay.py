"""The probe's recorder, alone, against vLLM's real scheduler (tests/probe_vllm/ops_replay.py): with shared
prefixes, preemption and each kind of KV cache group, its ops replayed after every step give vLLM's pool block by
block (ref counts, hashes, the free queue, the hash map's entries), and a write made outside the pool's methods, as a
manager's copy-on-write makes it, is an op too. (The mirror's tests check kvscope's reading of the same ops; this
checks the ops themselves, every step.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from vllm_live import ROOT, SERVE_ENV, model_folder, need_vllm

from kvscope_vllm_probe.constants import OP_REF

SCRIPT = ROOT / "tests" / "probe_vllm" / "ops_replay.py"


@pytest.fixture(scope="module")
def vllm_python():
    return need_vllm()


@pytest.mark.parametrize("groups", ["full", "sliding:32,full", "mamba,full"])
def test_the_ops_replayed_are_vllms_pool_after_every_step(vllm_python, groups):
    env = {**os.environ, **SERVE_ENV, "KVSCOPE_VLLM_MODEL": model_folder()}
    r = subprocess.run(
        [vllm_python, str(SCRIPT), "--groups", groups], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["finished"] and out["steps"] > 100 and out["preemptions"] > 0
    assert out["problems"] == []
    ref_ops = [op for op in out["stray_ops"] if op[0] == OP_REF]
    assert len(ref_ops) == 1 and ref_ops[0][2] == 1
