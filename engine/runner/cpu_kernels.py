"""The CPU's C kernels (``csrc/``): decode attention over the paged cache, and a layer's small ops fused.

Plain C over raw buffers, compiled on first use by the system's C compiler (``cc``, about a second) into one
library in kvscope's cache folder, and called through ctypes: no PyTorch headers, no build system. The library is
named by its sources, flags and compiler, and built beside its final name then renamed, so a process loading it
never sees half a file. Where it cannot be built (no compiler), the CPU runs PyTorch's ops instead, after one log
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

logger = logging.getLogger("engine")

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("cpu_decode.c", "cpu_fused.c")
HEADERS = ("cpu_math.h",)
# -march=native: the build is this machine's (the cache folder is per user, the file named by the source, flags and
# compiler); the loops vectorise to its widest instructions. No -ffast-math: `omp simd` alone vectorises the sums.
# -fno-trapping-math: a float compare may then be a select (nothing here reads the FP exception flags); without it
# GCC 12 keeps the ternaries of exp's clamp and SiLU's sign as branches and vectorises none of those loops (SiLU
# at 32 rows took 6x PyTorch's time). It changes no value.
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]

i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# each entry point's arguments, in the order the C declares them
SIGNATURES: dict[str, list] = {
    "kvscope_decode_attention": [ptr] * 6 + [i64] * 6 + [f32, c_int],
    "kvscope_add_rms_norm": [ptr, i64, ptr, c_int, ptr, ptr, i64, i64, f32, c_int],
    "kvscope_rope_and_store": [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr]
    + [i64] * 4
    + [c_int],
    "kvscope_silu_and_mul": [ptr, i64, ptr, i64, i64, c_int],
}
RESTYPES = {"kvscope_decode_attention": c_int}

_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "kernels"


def library() -> ctypes.CDLL | None:
    """The compiled library (its entry points typed), or None where it cannot be built (the reason logged once)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]


def function(name: str, off_switch: str = ""):
    """One entry point of the library, or None where it cannot be built or the environment variable
    ``off_switch`` says "torch". Read once and kept (a layer asks for it every step)."""
    key = (name, off_switch)
    if key not in _state:
        off = bool(off_switch) and os.environ.get(off_switch, "") == "torch"
        lib = None if off else library()
        _state[key] = getattr(lib, name) if lib is not None else None
    return _state[key]


def _load() -> ctypes.CDLL | None:
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        texts = [(CSRC / name).read_text() for name in (*SOURCES, *HEADERS)]
        key = hashlib.sha256("\0".join([*texts, *CFLAGS, version]).encode()).hexdigest()[:16]
        path = cache_dir() / f"cpu_kernels-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                sources = [str(CSRC / name) for name in SOURCES]
                subprocess.run(
                    [cc, *CFLAGS, f"-I{CSRC}", *sources, "-o", tmp, "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                )
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        logger.warning(
            "CPU kernels unavailable (%s: %s); using PyTorch's ops",
            type(e).__name__,
            str(detail).strip().splitlines()[-1] if str(detail).strip() else "",
        )
        return None
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, RESTYPES.get(name)
    return lib
