"""The internals the probe reads, against vLLM 0.20, 0.32 and 0.33 as their released wheels define them
(``tests/probe/vllm_surfaces.json``, read from the wheels' files by ``scripts/vllm_surface.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope_vllm_probe.compat import KNOWN_RELEASES, OPTIONAL, REQUIRED, SLOTS, release_of

SURFACES = json.loads((Path(__file__).parent / "vllm_surfaces.json").read_text())


@pytest.mark.parametrize("release", KNOWN_RELEASES)
def test_every_internal_the_probe_reads_is_in_the_release(release):
    classes = SURFACES[release]["classes"]
    for cls, names in REQUIRED.items():
        have = set(classes[cls]["methods"]) | set(classes[cls]["attributes"])
        assert set(names) <= have, f"vLLM {release} {cls} lacks {sorted(set(names) - have)}"
    block = classes["KVCacheBlock"]
    assert block["slots"] and set(SLOTS) <= set(block["fields"])  # the recorder's descriptors go over slots


def test_what_differs_between_releases_is_what_the_probe_handles():
    has = {
        r: (
            set(SURFACES[r]["classes"]["FreeKVCacheBlockQueue"]["methods"]),
            set(SURFACES[r]["classes"]["Scheduler"]["attributes"]),
        )
        for r in KNOWN_RELEASES
    }
    assert "prepend_n" not in has["0.20"][0] and "deferred_frees" not in has["0.20"][1]  # every free to the tail
    for r in ("0.32", "0.33"):
        assert set(OPTIONAL["FreeKVCacheBlockQueue"]) <= has[r][0] and set(OPTIONAL["Scheduler"]) <= has[r][1]
        manager = set(SURFACES[r]["classes"]["KVCacheManager"]["methods"])
        assert set(OPTIONAL["KVCacheManager"]) <= manager  # the lookup of a request scheduled with a connector
    # 0.20 sets a block's hash through a property, 0.32+ through set_block_hash: both write the slot the
    # recorder watches
    assert "set_block_hash" not in SURFACES["0.20"]["classes"]["KVCacheBlock"]["methods"]
    assert "set_block_hash" in SURFACES["0.33"]["classes"]["KVCacheBlock"]["methods"]


def test_releases_by_version_string():
    assert release_of("0.32.0") == "0.32" and release_of("0.33.1") == "0.33" and release_of("0.20.2") == "0.20"
    assert release_of("0.32.1.dev3+gabc") == "0.32"
    assert release_of("0.31.0") is None and release_of("1.0.0") is None and release_of("nonsense") is None
