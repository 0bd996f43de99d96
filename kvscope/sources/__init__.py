"""Where step records come from besides the in-process engine: today an attached external engine.

``attached``: a subscriber to vLLM-format KV events (vLLM, SGLang, a publishing kvscope) and
its trace replay; ``remote_cache``: the prefix-forest model it maintains; ``attach_trace``:
the trace format. (The live engine and kvscope's own trace replay are in ``kvscope.session``.)
"""
