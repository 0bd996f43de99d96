"""Ending a window's life at a moment of our choosing, not the garbage collector's."""

from __future__ import annotations

from PySide6.QtCore import QCoreApplication, QEvent
from PySide6.QtWidgets import QWidget


def dispose(win: QWidget) -> None:
    """Delete ``win``'s C++ side (and its children: plots, scenes, their items) now.

    A closed top-level window that Python still holds in a reference cycle (a timer's slot bound to a
    driver that holds the window) would otherwise be destroyed from inside a later garbage collection:
    whatever the process is doing then (another window's event loop, in the tests) sees pyqtgraph's
    weak maps emptied under it mid-collection, which is how a PySide6 process segfaults. Deleting it
    here, with its deferred deletes sent at once, leaves only dead wrappers for the collector."""
    if win.isVisible():  # closed already on the usual paths; a second closeEvent would save settings twice
        win.close()
    win.deleteLater()
    delete_posted()


def delete_posted() -> None:
    """Carry out every ``deleteLater`` posted so far, now: outside an event loop Qt would keep them for the next
    loop that runs, and delete those widgets in the middle of whatever it is doing."""
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
