"""What the window and ``--headless`` show: a ``Source`` yields step records (``base``).

``live``: an engine in this process; ``replay``: kvscope's own trace; ``attached``: a subscriber to vLLM-format
KV events (vLLM, SGLang, a publishing kvscope) and the replay of its trace, ``Source``s too (capability
``PREFIX_FOREST``), with ``attach_record`` (one poll), ``remote_cache`` (the prefix forest it keeps),
``attach_trace`` and ``attach_history``; ``fleet``: several attached engines watched together (capability
``FLEET``), with ``fleet_index``, ``hash_check``, ``fleet_route``, ``fleet_spec``, ``fleet_metrics`` and
``fleet_record``; ``summary``: what a run amounts to.
"""
