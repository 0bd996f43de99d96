"""kvscope's probe for vLLM: a general plugin that publishes the scheduler's block pool as it changes.

Inert unless ``KVSCOPE_PROBE_ENDPOINT`` is set in vLLM's environment (see ``plugin.register``). The wire
(``wire.py``) is the one schema both ends import; nothing here imports Qt or kvscope's engine.
"""

__version__ = "0.1.0"
