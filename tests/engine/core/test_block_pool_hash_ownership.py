"""Only ``BlockPool`` changes a block's hash or the hash map (each change is one event)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MUTATORS = {"pop", "clear", "update", "setdefault", "popitem", "__delitem__", "__setitem__"}


def hash_edits(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            # a block's hash set (``b.block_hash = h``) or the pool's map edited (``pool.cached[h] = b``);
            # a mirror keyed by hash (``mirror[e.block_hash] = ...``) reads a hash, it does not edit one
            for sub in [t] if not isinstance(t, (ast.Tuple, ast.List)) else t.elts:
                if isinstance(sub, ast.Attribute) and sub.attr == "block_hash":
                    lines.append(node.lineno)
                if (
                    isinstance(sub, ast.Subscript)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "cached"
                ):
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "cached":
                lines.append(node.lineno)
    return sorted(set(lines))


def test_nothing_but_the_block_pool_edits_hashes():
    found = {}
    for path in sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "kvscope").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("engine/core/block_pool.py", "engine/inspect/replay.py"):  # the pool, and its mirror
            continue
        lines = hash_edits(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[rel] = lines
    assert not found, f"hash or hash-map edits outside BlockPool: {found}"


def test_the_check_sees_an_edit():
    code = "b.block_hash = None\npool.cached.pop(h)\ndel pool.cached[h]\nx.cached[h] = b\n"
    assert hash_edits(ast.parse(code)) == [1, 2, 3, 4]


def test_a_mirror_keyed_by_hash_is_not_an_edit():
    assert hash_edits(ast.parse("mirror[e.block_hash] = c\nseen[b.block_hash] += 1\n")) == []
