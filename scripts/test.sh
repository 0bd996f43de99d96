#!/usr/bin/env bash
# The test command: headless, offline, every test (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
export QT_QPA_PLATFORM=offscreen HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Two pytest-xdist workers (KVSCOPE_TEST_WORKERS to change), a test file on one worker (its module-scoped fixtures
# start once): one process took 36 min in CI on this 2-core machine, two about 20. The servers the tests start get
# their ports from tests/ports.py, a slice of its own for each worker. The files go out longest first
# (tests/file_order.py; --no-loadscope-reorder keeps that order). The 25 slowest tests are listed at the end.
# OMP_NUM_THREADS=1: the tiny models gain nothing from threads.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q -n "${KVSCOPE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
