"""Before Qt starts: will its xcb platform plugin load? (No Qt import here.)

Without the X11 libraries it links (libxcb-cursor0 and friends, which a minimal Linux lacks),
Qt prints a paragraph and aborts the process with SIGABRT. We ask the dynamic loader first
(``ldd`` on the plugin, which lists every missing library, transitive ones included) and name
the Debian/Ubuntu packages to install in one line instead.

    python -m kvscope.platform_check   # prints what is missing, exit 1; nothing missing: exit 0
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# sonames whose Debian package is not the usual spelling (libfoo.so.N -> libfooN).
DEBIAN_PACKAGES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-xinerama.so.0": "libxcb-xinerama0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libX11.so.6": "libx11-6",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libOpenGL.so.0": "libopengl0",
    "libfontconfig.so.1": "libfontconfig1",
    "libfreetype.so.6": "libfreetype6",
    "libdbus-1.so.3": "libdbus-1-3",
    "libglib-2.0.so.0": "libglib2.0-0",
    "libSM.so.6": "libsm6",
    "libICE.so.6": "libice6",
    "libz.so.1": "zlib1g",
}
# What Qt 6's xcb plugin needs on Debian/Ubuntu (the list Qt's own documentation gives).
XCB_PACKAGES = (
    "libxcb-cursor0",
    "libxcb-icccm4",
    "libxcb-keysyms1",
    "libxcb-image0",
    "libxcb-render-util0",
    "libxcb-xinerama0",
    "libxcb-xkb1",
    "libxkbcommon-x11-0",
    "libegl1",
    "libfontconfig1",
    "libdbus-1-3",
)


def debian_package(soname: str) -> str:
    """The Debian package that ships ``soname`` (libfoo-bar.so.3 -> libfoo-bar3, libx.so.0.1 -> libx0)."""
    if soname in DEBIAN_PACKAGES:
        return DEBIAN_PACKAGES[soname]
    m = re.fullmatch(r"(lib[\w.+-]+?)\.so\.(\d+)(?:\.\d+)*", soname)
    if not m:
        return soname
    name, major = m.group(1).lower(), m.group(2)
    return f"{name}-{major}" if name[-1].isdigit() else f"{name}{major}"


def xcb_plugin() -> Path | None:
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    return p if p.is_file() else None


def _ldd(path: Path) -> str:
    """ldd's report; without ldd, what dlopen says in a child process (the first missing library only)."""
    ldd = shutil.which("ldd")
    if ldd is not None:
        return subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=30).stdout
    probe = "import ctypes, sys\ntry:\n    ctypes.CDLL(sys.argv[1])\nexcept OSError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"(\S+\.so[.\d]*): cannot open shared object file", out)
    return f"\t{m.group(1)} => not found\n" if m else ""


def missing_libraries(plugin: Path, ldd=None) -> list[str]:
    """sonames the loader cannot find for ``plugin`` (ldd's "=> not found" lines), in order, once each."""
    found = re.findall(r"^\s*(\S+)\s+=>\s+not found", (ldd or _ldd)(plugin), re.MULTILINE)
    return list(dict.fromkeys(found))


def uses_xcb(env=os.environ, platform: str = sys.platform) -> bool:
    """Whether Qt would pick the xcb platform plugin here."""
    if platform != "linux":
        return False
    qpa = env.get("QT_QPA_PLATFORM", "").split(":")[0].split(";")[0]
    if qpa:
        return qpa == "xcb"
    return bool(env.get("DISPLAY")) and not env.get("WAYLAND_DISPLAY")


def xcb_problem(env=os.environ, plugin: Path | None = None, ldd=None) -> str | None:
    """One line naming the packages to install if Qt's xcb plugin would fail to load; else None."""
    if not uses_xcb(env):
        return None
    plugin = plugin or xcb_plugin()
    if plugin is None:
        return None  # no PySide6 wheel layout we know: let Qt speak for itself
    missing = missing_libraries(plugin, ldd)
    if not missing:
        return None
    packages = " ".join(dict.fromkeys(debian_package(s) for s in missing))
    return (
        f"the window needs system libraries Qt's xcb plugin cannot find ({', '.join(missing)}); on "
        f"Debian/Ubuntu: sudo apt-get install {packages} (or run kvscope --headless)"
    )


def main() -> int:
    plugin = xcb_plugin()
    if plugin is None:
        print("kvscope: PySide6's xcb platform plugin was not found")
        return 1
    missing = missing_libraries(plugin)
    if missing:
        packages = " ".join(dict.fromkeys(debian_package(s) for s in missing))
        print(f"kvscope: for the window, install: sudo apt-get install {packages}")
        return 1
    print("kvscope: the window's system libraries are all there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
