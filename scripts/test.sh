#!/usr/bin/env bash
# The test command: headless, offline, every test (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
export QT_QPA_PLATFORM=offscreen HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Three pytest-xdist workers on two cores (KVSCOPE_TEST_WORKERS to change), a test file on one worker (its
# module-scoped fixtures start once). One process took 36 min in CI on this 2-core machine, two workers 13 min 4 s
# with the cores 88% busy (the probe's tests wait on vLLM's children, on 5 s heartbeat rules and on sockets, and a
# second worker alone cannot fill a core while the first waits), three 12 min 34 s with them 98% busy (a run of each
# on an AMD EPYC, 2026-12-07). The servers the tests start get their ports from tests/ports.py, a slice of its own for
# each worker. The files go out longest first (tests/file_order.py; --no-loadscope-reorder keeps that order). The 25
# slowest tests are listed at the end.
# OMP_NUM_THREADS=1: the tiny models gain nothing from threads.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q -n "${KVSCOPE_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
