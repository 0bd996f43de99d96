"""The test files' durations on this machine, from a JUnit report: what ``tests/file_order.py`` sorts by.

    bash scripts/test.sh --junitxml=/tmp/junit.xml && python scripts/file_durations.py /tmp/junit.xml

Writes tests/file_durations.json: each file's seconds (setup, call and teardown of all its tests), rounded up.
Refresh it when files come, go or change much; a stale entry only makes the order a little worse.
"""

from __future__ import annotations

import json
import math
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "file_durations.json"


def file_of(classname: str) -> str:
    """``tests.kvscope.cli.test_stopping`` (a module's tests) or ``....test_x.TestY`` (a class's) -> the file."""
    parts = classname.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/file_durations.py JUNIT_XML", file=sys.stderr)
        return 2
    seconds: Counter[str] = Counter()
    for case in ET.parse(argv[0]).iter("testcase"):
        seconds[file_of(case.get("classname", ""))] += float(case.get("time", 0))
    OUT.write_text(json.dumps({f: math.ceil(s) for f, s in sorted(seconds.items())}, indent=0) + "\n")
    print(f"{OUT.name}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
