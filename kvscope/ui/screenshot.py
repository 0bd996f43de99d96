"""Saving a window as a PNG (``--screenshot``): one way for the main, attach and fleet windows."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtWidgets import QApplication, QWidget


def save_window(win: QWidget, path: str) -> bool:
    """Grab ``win`` (after pending events) into ``path``, its folders made; say so in one line. Returns whether
    it was saved."""
    QApplication.processEvents()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        ok = win.grab().save(str(path))
    except OSError as e:
        ok = False
        print(f"kvscope: {e}", file=sys.stderr)
    if ok:
        print(f"kvscope: saved {path}")
    else:
        print(f"kvscope: could not save {path}", file=sys.stderr)
    return ok
