"""scripts/file_durations.py's table and what tests/file_order.py does with it: the files longest first, each
file's tests together and in their own order."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from file_order import UNKNOWN_S, file_seconds, longest_first

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from file_durations import file_of  # noqa: E402

ROOT = Path("/repo")


def item(path: str, name: str):
    return SimpleNamespace(path=ROOT / path, name=name)


def test_longest_file_first_and_each_files_tests_in_their_order():
    items = [item("tests/a.py", "a1"), item("tests/b.py", "b1"), item("tests/a.py", "a2"), item("tests/c.py", "c1")]
    items.append(item("tests/b.py", "b2"))
    out = longest_first(items, {"tests/a.py": 3, "tests/b.py": 90, "tests/c.py": 40}, ROOT)
    assert [i.name for i in out] == ["b1", "b2", "c1", "a1", "a2"]


def test_a_file_not_in_the_table_counts_as_a_typical_file_and_ties_keep_the_collections_order():
    items = [item("tests/new.py", "n1"), item("tests/long.py", "l1"), item("tests/short.py", "s1")]
    items.append(item("tests/same.py", "t1"))
    table = {"tests/long.py": UNKNOWN_S + 1, "tests/short.py": UNKNOWN_S - 1, "tests/same.py": UNKNOWN_S}
    assert [i.name for i in longest_first(items, table, ROOT)] == ["l1", "n1", "t1", "s1"]


def test_the_checked_in_table_names_files_that_exist():
    table = file_seconds()
    assert table, "tests/file_durations.json is missing or empty"
    root = Path(__file__).resolve().parents[1]
    gone = [f for f in table if not (root / f).is_file()]
    assert not gone, f"refresh it with scripts/file_durations.py: {gone}"


def test_a_junit_class_name_is_its_file():
    assert file_of("tests.kvscope.cli.test_stopping") == "tests/kvscope/cli/test_stopping.py"
    assert file_of("tests.engine.test_x.TestY") == "tests/engine/test_x.py"  # a class's tests
