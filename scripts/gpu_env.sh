# Sourced (from the repo root) by scripts/gpu_check.sh on the lent GPU: its image has torch, triton and
# transformers but not the window's, the server's or the KV events' packages, nor the system libraries Qt
# links. .whl/ (scripts/make_gpu_wheels.sh; git-ignored, it travels with the working tree) brings them:
# local files only, the image has no network. Where all of them import already, this does nothing.
PY=${PY:-python3}
if [ -d .whl ] && ! "$PY" -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ('PySide6', 'pyqtgraph', 'msgspec', 'zmq', 'fastapi', 'uvicorn')))" 2>/dev/null
then
  # A wheel whose package the image has at least as new is left out, so the image's copy stays in force
  # (a newer typing_extensions, say); an older one is replaced (pydantic needs typing_extensions >= 4.16).
  mapfile -t _kv_wheels < <("$PY" -c '
import re, sys
from importlib.metadata import PackageNotFoundError, version
key = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])
for w in sys.argv[1:]:
    name, ver = w.rsplit("/", 1)[-1].split("-")[:2]
    try:
        if key(version(name)) >= key(ver):
            continue
    except PackageNotFoundError:
        pass
    print(w)
' .whl/*.whl)
  rm -rf /tmp/kvscope-site  # no stale packages from an earlier run
  if [ ${#_kv_wheels[@]} -gt 0 ] && ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/kvscope-site "${_kv_wheels[@]}"; then
    echo "gpu_env: pip could not install .whl/*.whl into /tmp/kvscope-site" >&2
  fi
  export PYTHONPATH="/tmp/kvscope-site${PYTHONPATH:+:$PYTHONPATH}"
  # Only the libraries this system lacks are put on the loader's path: a carried (Debian 12) libexpat or
  # libz ahead of the image's newer one would break the image's own Python modules that link them.
  rm -rf /tmp/kvscope-lib && mkdir -p /tmp/kvscope-lib  # no stale links from an earlier run
  _kv_have=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null | awk '/x86-64/ {print $1}')
  _kv_libs=()
  for _kv_f in .whl/lib/*; do
    _kv_n=${_kv_f##*/}
    [[ $'\n'$_kv_have$'\n' == *$'\n'$_kv_n$'\n'* ]] && continue
    ln -sfn "$PWD/$_kv_f" "/tmp/kvscope-lib/$_kv_n" && _kv_libs+=("$_kv_n")
  done
  export LD_LIBRARY_PATH="/tmp/kvscope-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" QT_QPA_PLATFORM=offscreen
  # An offscreen Qt with no font draws boxes. Qt finds fonts through fontconfig only (QT_QPA_FONTDIR is not
  # read): .whl/fonts.conf adds the carried font to the system's setup, if there is one.
  export FONTCONFIG_FILE="$PWD/.whl/fonts.conf"
  echo "gpu_env: installed ${#_kv_wheels[@]} wheels from .whl into /tmp/kvscope-site (PYTHONPATH);" \
    "${#_kv_libs[@]} carried libraries on LD_LIBRARY_PATH${_kv_libs:+ (${_kv_libs[*]})}; FONTCONFIG_FILE=$FONTCONFIG_FILE"
  unset _kv_wheels _kv_have _kv_libs _kv_f _kv_n
fi
