#!/usr/bin/env bash
# The test command: headless, offline, every test (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
export QT_QPA_PLATFORM=offscreen HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# KVSCOPE_TEST_WORKERS=2 runs two pytest-xdist workers, a test file on one worker (its module-scoped fixtures start
# once): the suite took 19.7 min that way on this 2-core machine. Not the default yet: two workers' vLLM-CPU servers race for ports (a port
# found free was taken by the other worker's vLLM before its probe bound it). OMP_NUM_THREADS=1: the tiny models
# gain nothing from threads.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q -n "${KVSCOPE_TEST_WORKERS:-0}" --dist loadfile "$@"
