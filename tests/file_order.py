"""The test files in the order the workers finish soonest: the longest first (a pytest plugin, conftest's).

``scripts/test.sh`` runs each file on one pytest-xdist worker (``--dist loadfile``) and hands the next file to
the worker that runs low, in the collection's order (``--no-loadscope-reorder``: xdist's own order is by the
number of tests, which put a one-test file of two minutes last). The longest files first, the short ones
filling the gaps at the end, is the classic schedule for this (longest processing time first). The seconds
come from a run on this machine (``tests/file_durations.json``, written by ``scripts/file_durations.py``); a
file not in it is taken as ``UNKNOWN_S``. Only the order changes: every test runs, in its own file's order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("file_durations.json")
UNKNOWN_S = 10.0  # a new file: about a typical file's time, so it neither leads nor trails the run


def file_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # no table: the collection's own order


def longest_first(items: list[pytest.Item], seconds: dict[str, float], root: Path) -> list[pytest.Item]:
    """``items`` grouped by file, the files by their seconds, longest first (ties: the collection's order)."""
    files = [_file(item, root) for item in items]  # each item's file, worked out once
    first: dict[str, int] = {}
    for i, f in enumerate(files):
        first.setdefault(f, i)
    order = sorted(range(len(items)), key=lambda i: (-seconds.get(files[i], UNKNOWN_S), first[files[i]], i))
    return [items[i] for i in order]


def _file(item: pytest.Item, root: Path) -> str:
    try:
        return item.path.relative_to(root).as_posix()
    except ValueError:
        return item.path.as_posix()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = file_seconds()
    if seconds:
        items[:] = longest_first(items, seconds, config.rootpath)
