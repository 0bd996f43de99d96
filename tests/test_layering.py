"""engine/ never imports Qt (napari's rule for its models); neither does the server."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = ("PySide6", "pyqtgraph", "PyQt5", "PyQt6", "qtpy", "kvscope")


def test_no_engine_module_imports_qt():
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in FORBIDDEN, f"{path.relative_to(ROOT)} imports {n}"


def test_importing_engine_loads_no_qt():
    code = "import sys, engine; print(any(m.startswith(('PySide6', 'pyqtgraph')) for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_server_loads_no_qt_and_the_command_line_no_server():
    """The server must run wherever the engine runs (a child process, later); ``kvscope --help`` stays light."""
    code = ("import sys, kvscope.serve.server, kvscope.serve.headless, kvscope.serve.driver; "
            "print(any(m.startswith(('PySide6', 'pyqtgraph')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    code = "import sys, kvscope.cli; print(any(m.split('.')[0] in ('fastapi', 'uvicorn') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
