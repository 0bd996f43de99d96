#!/usr/bin/env bash
# Debian/Ubuntu packages for the real-window tests: Xvfb (a virtual X screen), xdotool (keys and clicks),
# tesseract-ocr (text read off a screenshot) and the X11 libraries Qt's xcb plugin links; and gcc, which builds
# the CPU kernels (engine/runner/csrc/). Without them those tests skip, saying what to
# install (CI sets KVSCOPE_REQUIRE_DISPLAY=1 and KVSCOPE_REQUIRE_COMPILER=1 so they fail instead).
set -euo pipefail
PKGS="gcc xvfb xdotool tesseract-ocr libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0
      libxcb-xinerama0 libxcb-xkb1 libxkbcommon-x11-0 libegl1 libfontconfig1 libdbus-1-3"
missing=$(for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
[ -z "$missing" ] && exit 0
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086
$SUDO apt-get install -y -q $missing >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q $missing >/dev/null; }
