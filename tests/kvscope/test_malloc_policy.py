"""The window's malloc policy (kvscope.malloc_policy): on glibc the mmap threshold is fixed, so a large
temporary is mapped and unmapped and leaves no hole in the heap; freed pages go back to the system."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
# How much of a redraw's large copies land in the brk heap (KiB), after a larger block was freed.
CHURN = """
import sys
from kvscope.malloc_policy import give_back, tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
def heap_kb():
    total, on = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            on = len(head) > 5 and head[5] == "[heap]"
        elif on and head[0] == "Rss:":
            total += int(head[1])
    return total
big = bytearray(4 << 20)
del big  # glibc raises its mmap threshold to 4 MiB here, unless it was fixed
before = heap_kb()
frames = [bytearray(200_000) for _ in range(50)]  # a redraw's copies of long series (10 MB)
grew = heap_kb() - before
del frames
give_back()
print(grew)
"""


def heap_growth(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt and malloc_trim: Linux with glibc only")
def test_large_temporaries_are_mapped_not_carved_from_the_heap():
    tuned, default = heap_growth("tuned"), heap_growth("default")
    assert tuned < 512, tuned  # mapped: freed, they go back at once
    assert default > 8_000, default  # glibc's own threshold had risen: 10 MB taken from the heap
