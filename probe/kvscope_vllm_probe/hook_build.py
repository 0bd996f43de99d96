"""Which block hook a process uses: the compiled one (``_blockhook.c``, built by ``pip install`` where a C
compiler is at hand) or the Python one in recorder.py, which keeps the same rule more slowly.

``KVSCOPE_PROBE_PURE_PYTHON=1`` in vLLM's environment picks the Python hook even where the compiled one was built
(the tests run both). It is read when the probe installs its hooks, not at import: a vLLM engine core forked
from a process that imported the probe still reads its own environment.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ENV_PURE_PYTHON = "KVSCOPE_PROBE_PURE_PYTHON"


def compiled_hook() -> ModuleType | None:
    """The compiled hook's module, or None: not built here, or the Python one asked for."""
    if os.environ.get(ENV_PURE_PYTHON) == "1":
        return None
    try:
        return importlib.import_module(f"{__package__}._blockhook")
    except ImportError:  # not built: no compiler where the probe was installed
        return None
