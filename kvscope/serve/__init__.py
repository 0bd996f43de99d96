"""An OpenAI-compatible server beside the engine: handlers only add, read and abort requests.

``OpenAIServer`` (uvicorn on a thread) holds a ``RequestBridge``, a ``StepHook`` of the session
that moves requests in and outputs out between steps on the engine's own thread.
Imports are lazy: the command line reads ``options`` without loading the server stack.
"""

from __future__ import annotations

import importlib

from kvscope.serve.options import ServeOptions

_LAZY = {"OpenAIServer": ".server", "RequestBridge": ".bridge", "RequestStream": ".bridge"}
__all__ = ["OpenAIServer", "RequestBridge", "RequestStream", "ServeOptions"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
