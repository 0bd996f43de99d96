"""Every test file is named after what it covers: ``test_<module>[_<behaviour>].py``, where ``<module>`` is a module,
package or script of the product (engine/, kvscope/, the probe, bench/, scripts/), so a reader finds a module's tests
by its name. The few that cover the whole tree rather than one module are named here, with what they cover."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "kvscope", "probe/kvscope_vllm_probe", "bench", "scripts")

# Tests of the whole tree, not of one module.
WHOLE_TREE = {
    "test_layering": "the import graph: layers point down, no cycles",
    "test_naming": "this rule",
    "test_quoted_commands": "every command the README, docs and scenario notes quote",
}


def product_names() -> set[str]:
    names = set()
    for root in PRODUCT:
        for p in (ROOT / root).rglob("*"):
            if p.suffix in (".py", ".sh") and ".venv" not in p.parts:
                names.add(p.stem)
                names.add(p.parent.name)
    return names


def test_every_test_file_is_named_after_a_module_or_said_here():
    names = product_names()
    unnamed = []
    for t in sorted((ROOT / "tests").rglob("test_*.py")):
        stem = t.stem
        if stem in WHOLE_TREE:
            continue
        parts = stem[len("test_") :].split("_")
        if not any("_".join(parts[:i]) in names for i in range(1, len(parts) + 1)):
            unnamed.append(str(t.relative_to(ROOT)))
    assert not unnamed, f"test files named after no module (rename them, or add them to WHOLE_TREE): {unnamed}"
