"""The probe's one compiled part, the block hook (``_blockhook.c``): optional, since the probe runs the same rule in
Python where no compiler is at hand (recorder.py), only slower for vLLM."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvscope_vllm_probe._blockhook", ["kvscope_vllm_probe/_blockhook.c"], optional=True)])
