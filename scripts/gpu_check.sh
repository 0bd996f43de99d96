#!/usr/bin/env bash
# One check for a lent GPU: installs nothing from the network.
#   bash scripts/gpu_check.sh [--model /path/to/llama-2-7b-hf]
# Needs a Python with a CUDA build of torch, triton and this project's dependencies:
# .venv (made with KVSCOPE_KEEP_TORCH=1 bash scripts/setup.sh over a CUDA torch) or $PYTHON.
# 1. the CUDA tests: Triton kernels compiled for real against the PyTorch reference, the engine
#    (Triton backend, CUDA graphs) token-identical to transformers on the tiny model;
# 2. the decode benchmark (batch 1, 16, 64) against transformers' generate, with the achieved
#    fraction of memory bandwidth, on --model's weights or a random model of Llama-2-7B's shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MODEL_ARGS=()
[ "${1:-}" = "--model" ] && MODEL_ARGS=(--model "$2")
# A Python that lacks one of the project's pure dependencies (an image with torch and triton but not
# msgspec, say) takes it from wheels in .whl/ when there are any (`pip download` them elsewhere): local
# files only, into a folder of its own.
if [ -d .whl ] && ! "$PY" -c "import msgspec" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/kvscope-site .whl/*.whl \
    && export PYTHONPATH="/tmp/kvscope-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 QT_QPA_PLATFORM=offscreen
unset TRITON_INTERPRET
OUT_DIR=${OUT:-bench/results}
mkdir -p "$OUT_DIR"

"$PY" - <<'PY' || { echo "gpu_check: no CUDA here"; exit 2; }
import torch, triton
assert torch.cuda.is_available(), "torch has no CUDA"
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PY

t0=$SECONDS
"$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_cuda_path.py \
  tests/test_oracle_tiny.py tests/test_beam_search.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -15
tests_rc=${PIPESTATUS[0]}
tests_s=$((SECONDS - t0))

t0=$SECONDS
"$PY" bench/gpu_decode.py "${MODEL_ARGS[@]}" --out "$OUT_DIR/gpu_decode.json" 2>&1 | tee "$OUT_DIR/gpu_bench.log" \
  | grep -v "^\s*$" | tail -8
bench_rc=${PIPESTATUS[0]}
bench_s=$((SECONDS - t0))

echo
echo "| check | result | seconds |"
echo "|---|---|---:|"
echo "| CUDA tests (kernels, engine vs transformers) | $([ "$tests_rc" = 0 ] && echo pass || echo "FAIL ($tests_rc)") | $tests_s |"
echo "| decode benchmark | $([ "$bench_rc" = 0 ] && echo done || echo "FAIL ($bench_rc)") | $bench_s |"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
