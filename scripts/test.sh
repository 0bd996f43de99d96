#!/usr/bin/env bash
# The test command: headless, offline, every test (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
export QT_QPA_PLATFORM=offscreen HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m pytest -q "$@"
