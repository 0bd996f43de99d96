"""How the window's process asks glibc's malloc to hand memory back (Linux; elsewhere nothing is done).

A window left open on a served engine drops and adds thousands of timeline entries a minute and redraws
plots whose series are copied each frame (54,000 steps: 430 KB an array, a dozen a frame). glibc's
malloc raises its mmap threshold each time a large mapped block is freed (up to 32 MB), after which
those per-frame copies come from the heap between long-lived entries, and the heap only grows: the
window gained ~3 MB a minute for half an hour with every store within its bound. So:

- ``tune_malloc()`` fixes the mmap threshold at 128 KiB (which also turns the dynamic raising off): a
  large temporary is mapped and unmapped, never left as a hole in the heap;
- ``give_back()`` (after the timeline drops its oldest steps) returns the heap's whole free pages.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc's, or not glibc
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def tune_malloc(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold; True where it was set."""
    return bool(_LIBC is not None and _LIBC.mallopt(M_MMAP_THRESHOLD, threshold) == 1)


def give_back() -> None:
    """Return the heap's whole free pages to the system (``malloc_trim``: a few ms, once a drop)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
