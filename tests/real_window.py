"""A real X window for a test: an Xvfb display of its own, kvscope started in it through its own entry point by a
driver (``tests/window_driver.py``, in a child process with Qt's xcb platform), real key and mouse events sent
with xdotool, and the driver's answers (JSON) to read.

The test process's own Qt is offscreen (``tests/conftest.py``): the real window lives in the child. Without Xvfb
or xdotool the tests that need them skip, saying what to install (``scripts/setup_display.sh``); CI sets
``KVSCOPE_REQUIRE_DISPLAY=1`` so they fail instead.

    need_display()
    with Xvfb((1280, 720)) as x, RealWindow(x, ["--scenario", "four-score"]) as win:
        win.ask({"do": "wait", "for": "loaded"})
        win.key("F11")                       # a real key press, to the window that has the focus
        report = win.ask({"do": "measure"})  # what the driver measured in its window (see the driver)
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "window_driver.py"
INSTALL = "needs Xvfb and xdotool for a real window: bash scripts/setup_display.sh (apt: xvfb xdotool)"


def need_display() -> None:
    """Skip unless Xvfb and xdotool are installed (fail instead under ``KVSCOPE_REQUIRE_DISPLAY=1``, as CI sets)."""
    missing = [exe for exe in ("Xvfb", "xdotool") if shutil.which(exe) is None]
    if missing:
        msg = f"{INSTALL}; missing: {', '.join(missing)}"
        if os.environ.get("KVSCOPE_REQUIRE_DISPLAY") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


class Xvfb:
    """A virtual X screen on a free display number, ``size`` pixels at ``dpi`` (96: 1 pt = 4/3 px, as on a
    projector's usual setting), for as long as the ``with`` block lasts."""

    def __init__(self, size: tuple[int, int] = (1280, 720), dpi: int = 96) -> None:
        self.size, self.dpi = size, dpi
        self.proc: subprocess.Popen | None = None
        self.display = ""

    @property
    def env(self) -> dict[str, str]:
        return {"DISPLAY": self.display}

    def start(self, timeout: float = 20.0) -> Xvfb:
        for n in itertools.chain(range(90 + os.getpid() % 400, 500), range(90, 500)):
            if Path(f"/tmp/.X{n}-lock").exists() or Path(f"/tmp/.X11-unix/X{n}").exists():
                continue
            self.display = f":{n}"
            self.proc = subprocess.Popen(
                [shutil.which("Xvfb"), self.display, "-screen", "0", f"{self.size[0]}x{self.size[1]}x24"]
                # no key auto-repeat: on a loaded machine a key's release can come late enough to repeat it
                + ["-dpi", str(self.dpi), "-nolisten", "tcp", "-noreset", "-r"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            end = time.monotonic() + timeout
            while time.monotonic() < end and self.proc.poll() is None:
                if self.xdotool("getdisplaygeometry", check=False).returncode == 0:
                    return self
                time.sleep(0.05)
            self.stop()  # another test took this number first, or Xvfb failed: the next number
        raise RuntimeError("could not start Xvfb on any display :90-:499")

    def xdotool(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run xdotool on this display (its events are real X events: XTEST, as a keyboard's)."""
        return subprocess.run(
            ["xdotool", *args], env={**os.environ, **self.env}, capture_output=True, text=True, check=check, timeout=20
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> Xvfb:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RealWindow:
    """kvscope's window under ``display``: ``python tests/window_driver.py --reports DIR -- ARGS`` with DISPLAY
    set and ``QT_QPA_PLATFORM=xcb``, plus ``env``. ``ask`` sends the driver one command (a JSON line on its stdin)
    and returns its answer (a JSON file it writes); ``key`` and ``click`` send real X events to its window."""

    def __init__(self, display: Xvfb, args: list[str], env: dict[str, str] | None = None, driver: Path = DRIVER):
        self.display, self.args = display, list(args)
        self.dir = Path(tempfile.mkdtemp(prefix="kvscope-window-"))
        self._ids = itertools.count(1)
        self._wid: str | None = None
        # a settings folder of its own: a window starts from kvscope's default layout, never from the panels, text
        # size and tab that another test's window (or a person's) saved in ~/.config/kvscope
        config = self.dir / "config"
        config.mkdir()
        environ = {**os.environ, **display.env, "QT_QPA_PLATFORM": "xcb", "XDG_CONFIG_HOME": str(config), **(env or {})}
        environ.pop("QT_QPA_PLATFORM_PLUGIN_PATH", None)
        self.stdout_path, self.stderr_path = self.dir / "stdout.txt", self.dir / "stderr.txt"
        self.started = time.time()  # the command's start, as a user's shell would see it (the driver reports times)
        self.proc = subprocess.Popen(
            [sys.executable, str(driver), "--reports", str(self.dir), "--started", repr(self.started), "--", *args],
            cwd=ROOT,
            env=environ,
            stdin=subprocess.PIPE,
            stdout=self.stdout_path.open("w"),
            stderr=self.stderr_path.open("w"),
            text=True,
        )

    def ask(self, command: dict, timeout: float = 120.0) -> dict:
        """Send ``command`` to the driver and wait for its answer (a dict); raises with the window's stderr if the
        process ends or the answer does not come in time."""
        cid = next(self._ids)
        self.proc.stdin.write(json.dumps({**command, "id": cid}) + "\n")
        self.proc.stdin.flush()
        answer = self.dir / f"{cid}.json"
        end = time.monotonic() + timeout
        while not answer.exists():
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"the window exited ({code}) before answering {command}: {self.tail()}")
            if time.monotonic() > end:
                raise TimeoutError(f"no answer to {command} in {timeout:.0f} s: {self.tail()}")
            time.sleep(0.02)
        reply = json.loads(answer.read_text())
        if "error" in reply:
            raise RuntimeError(f"the driver failed on {command}: {reply['error']}")
        return reply

    def tail(self, n: int = 2000) -> str:
        return self.stderr_path.read_text(errors="replace")[-n:] if self.stderr_path.exists() else ""

    def window_id(self) -> str:
        """The X window id of the driver's active top-level window."""
        if self._wid is None:
            self._wid = str(self.ask({"do": "window"})["x_window"])
        return self._wid

    def focus(self) -> None:
        self.display.xdotool("windowfocus", "--sync", self.window_id())

    def key(self, *keys: str) -> None:
        """Press and release each key (xdotool's names: "F11", "F10", "Next", "ctrl+c") with the window focused:
        the events come from X's keyboard (XTEST), as a person's do."""
        # one xdotool run: focus, then the keys (two runs cost a process start each, on every step of a lesson)
        self.display.xdotool("windowfocus", "--sync", self.window_id(), "key", "--clearmodifiers", *keys)

    def click(self, x: int, y: int, button: int = 1) -> None:
        """Click at (x, y) of the window (its own pixels)."""
        self.display.xdotool("mousemove", "--window", self.window_id(), "--sync", str(x), str(y))
        self.display.xdotool("click", str(button))

    def close(self, timeout: float = 30.0) -> int:
        """Ask the driver to close its windows (kvscope exits as on a window close); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"do": "quit", "id": 0}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> RealWindow:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
