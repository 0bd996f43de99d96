#!/usr/bin/env bash
# The test command: headless, offline, every test (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
export QT_QPA_PLATFORM=offscreen HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Two workers (pytest-xdist; KVSCOPE_TEST_WORKERS=0 runs in this process), a test file on one worker: a file's
# module-scoped fixtures (a vLLM server, the loaded SmolLM2) start once. OMP_NUM_THREADS=1: the tiny models gain
# nothing from threads, and two workers' thread pools fought over the two cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q -n "${KVSCOPE_TEST_WORKERS:-2}" --dist loadfile "$@"
