"""The one window fixture: ``open_window`` makes kvscope's main window on any source as a test needs it (its own
settings file, shown, started, loaded) and shuts every window it made down at the end of the test. A test file's
own fixture, if it has one, only says which source its windows show."""

from __future__ import annotations

import pytest


@pytest.fixture
def open_window(qtbot, tmp_path):
    from PySide6.QtCore import QSettings

    from kvscope.ui.main_window import MainWindow

    made = []

    def open_(
        backend,
        *,
        start: bool = True,
        loaded: str | None = "latest",
        timeout_ms: int = 60_000,
        size: tuple[int, int] | None = None,
        settings: QSettings | None = None,
        **kw,
    ) -> MainWindow:
        """``backend``: an ``EngineBackend`` or a factory of sources (as ``MainWindow`` takes it); ``loaded``: wait
        until the window has its source's info ("info"), and a first record ("latest"), or not at all (None)."""
        if settings is None:
            settings = QSettings(str(tmp_path / f"kvscope-{len(made)}.ini"), QSettings.Format.IniFormat)
        win = MainWindow(backend, settings, **kw)
        qtbot.addWidget(win)
        made.append(win)
        win.show()
        if start:
            win.start()
            if loaded is not None:
                qtbot.waitUntil(
                    lambda: win.info is not None and (loaded == "info" or win.latest is not None), timeout=timeout_ms
                )
        if size is not None:
            win.resize(*size)
        return win

    yield open_
    for w in made:
        w.shutdown()
