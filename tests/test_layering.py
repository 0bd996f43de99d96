"""Layers that only point down, and no import cycles: every import is read, inside functions too.

From the bottom: ``engine`` (no Qt, no kvscope) in its own layers (``engine.config``, the one source of every
option; ``engine.core``, the bookkeeping scheduling needs, which imports nothing of the inspector; ``engine.inspect``,
which listens to the core; ``engine.runner``, tensors and devices; the coordinator at ``engine``'s top level; and
``engine.workload``, traces through the whole engine), kvscope's Qt-free base modules, ``sources`` (what a run
yields), ``serve`` (HTTP handlers, no argparse), ``runtime`` (what hosts an engine: the engine process, its host,
building a source, the loop), ``ui`` (Qt: the window and its views), ``cli`` (every argparse, one function a
mode). A module may import its own layer or the ones below it, never above.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
QT = ("PySide6", "pyqtgraph", "PyQt5", "PyQt6", "qtpy")
BASE = (
    "kvscope.scenario",
    "kvscope.presets",
    "kvscope.sysinfo",
    "kvscope.state",
    "kvscope.history",
    "kvscope.diagnosis",
    "kvscope.platform_check",
    "kvscope.messages",
)
LAYERS = [
    ("engine.config", "engine.messages"),
    ("engine.core",),
    ("engine.inspect",),
    ("engine.runner",),
    ("engine",),
    ("engine.workload",),
    ("kvscope",) + BASE,
    ("kvscope.sources",),
    ("kvscope.serve",),
    ("kvscope.runtime",),
    ("kvscope.ui",),
    ("kvscope.cli", "kvscope.__main__"),
]


def modules(base: pathlib.Path = ROOT, packages: tuple[str, ...] = ("engine", "kvscope")) -> dict[str, pathlib.Path]:
    out = {}
    for pkg in packages:
        for p in (base / pkg).rglob("*.py"):
            parts = p.relative_to(base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports (module level, in functions, under TYPE_CHECKING), relative ones resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.update(f"{mod}.{a.name}" for a in node.names)
            found.add(mod)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges = {}
    for name, path in mods.items():
        targets = set()
        for t in imports(name, path):
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                targets.add(t)
        edges[name] = targets
    return edges


def layer(name: str) -> int:
    best, depth = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    return best


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer(m) < 0] == []


def test_no_import_points_up():
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets if layer(b) > layer(a))
    assert upward == []


def test_no_import_cycles():
    edges = graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in list(edges):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_core_imports_nothing_of_the_inspector():
    """Said on its own (the layers above say it too): the bookkeeping tells its listener, it never asks."""
    core = {a: sorted(t for t in ts if t.startswith("engine.inspect")) for a, ts in graph().items()}
    assert {a: ts for a, ts in core.items() if a.startswith("engine.core") and ts} == {}


def test_the_probe_imports_nothing_of_kvscope_nor_the_engine():
    """The probe runs inside vLLM's process, installed alone: it may import vLLM, pyzmq and msgspec only."""
    probe = modules(ROOT / "probe", ("kvscope_vllm_probe",))
    assert probe, "no probe modules found"
    wrong = {
        name: sorted(t for t in imports(name, path) if t.split(".")[0] in ("kvscope", "engine"))
        for name, path in probe.items()
    }
    assert {n: t for n, t in wrong.items() if t} == {}


def test_qt_only_in_the_ui():
    for name, path in modules().items():
        if name.startswith("kvscope.ui"):
            continue
        qt = [t for t in imports(name, path) if t.split(".")[0] in QT]
        assert qt == [], f"{name} imports {qt}"


def test_engine_never_imports_kvscope_and_importing_it_loads_no_qt():
    for name, path in modules().items():
        if name.startswith("engine"):
            assert not [t for t in imports(name, path) if t.split(".")[0] == "kvscope"], name
    code = "import sys, engine; print(any(m.startswith(('PySide6', 'pyqtgraph')) for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_server_loads_no_qt_and_the_command_line_loads_no_server_nor_sockets():
    """The server runs wherever the engine runs (the engine process); ``kvscope --help`` stays light."""
    code = (
        "import sys, kvscope.serve.server, kvscope.cli.serve, kvscope.runtime.loop; "
        "print(any(m.startswith(('PySide6', 'pyqtgraph')) for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    code = (
        "import sys, kvscope.cli.parser; kvscope.cli.parser.build_parser(); print(sorted({m.split('.')[0] for m in "
        "sys.modules} & {'fastapi', 'uvicorn', 'zmq', 'msgspec', 'torch', 'PySide6'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
