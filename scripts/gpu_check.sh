#!/usr/bin/env bash
# The acceptance run on a lent GPU: installs nothing from the network.
#   bash scripts/gpu_check.sh [--only NAME[,NAME]] [--dry-run]
# Sections (bench/gpucheck): kernels, decode, memory, full_pool, prefix, fp8, inspector, serving, window; each
# in its own process with its own time budget. Writes gpu_report.json and gpu_report.md (one table a section)
# into $OUT (the device tool's folder) or bench/results, and prints the markdown.
# --dry-run: every section on tiny shapes on the CPU (Triton's interpreter), the rehearsal a CI test runs.
# Needs a Python with torch, triton and transformers: .venv, $PYTHON, or the image's python3. What the image
# lacks (Qt, pyqtgraph, msgspec, pyzmq, fastapi, uvicorn, ...) comes from wheels in .whl/ (scripts/gpu_env.sh;
# scripts/make_gpu_wheels.sh makes them), local files only.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PY
# shellcheck source=scripts/gpu_env.sh
[ -f scripts/gpu_env.sh ] && . scripts/gpu_env.sh
export PYTHONPATH="$PWD:$PWD/probe${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  QT_QPA_PLATFORM=offscreen TOKENIZERS_PARALLELISM=false
if [[ " $* " == *" --dry-run "* ]]; then
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  unset TRITON_INTERPRET
  "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || { echo "gpu_check: no CUDA here (--dry-run rehearses on the CPU)"; exit 2; }
fi
exec "$PY" -m bench.gpucheck "$@"
