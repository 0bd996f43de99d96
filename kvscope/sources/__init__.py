"""What the window and ``--headless`` show: a ``Source`` yields step records (``base``).

``live``: an engine in this process; ``replay``: kvscope's own trace; ``attached``: a subscriber to vLLM-format
KV events (vLLM, SGLang, a publishing kvscope) and the replay of its trace, ``Source``s too (capability
``PREFIX_FOREST``), with ``attach_record`` (one poll), ``remote_cache`` (the prefix forest it keeps),
``attach_trace`` and ``attach_history``; ``summary``: what a run amounts to.
"""
