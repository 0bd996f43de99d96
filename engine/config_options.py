"""Command-line options made from a config dataclass's fields: one rule for every command line that sets them.

Each field (``engine.config.option`` metadata) becomes ``--field-name`` with its type, default, help and choices;
a bool becomes ``--x/--no-x`` (plus any alias the metadata names, such as ``--no-prefix-caching``); a number is
parsed and checked against the field's bounds as it is read, so a bad value is argparse's one line and exit 2.
``kvscope``'s parser and ``python -m engine.workload``'s both make their engine, workload and fleet flags here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable

from .config import EngineConfig, check_value, field_type


class OneLineParser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit code 2 (argparse's own usage block is several)."""

    def error(self, message: str):  # noqa: D401 - argparse's name
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def typed(f: dataclasses.Field, tp: type, cls: type = EngineConfig):
    """An argparse type that parses and checks one field's value against its metadata."""

    def parse(text: str):
        try:
            value = tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if tp is int else 'a number'}") from None
        try:
            check_value(f, value, cls)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    parse.__name__ = tp.__name__
    return parse


def add_field_option(g, cls: type, f: dataclasses.Field, default=dataclasses.MISSING) -> None:
    """One dataclass field as ``--field-name`` on ``g`` (a parser or a group); ``default``: a command line's own
    default instead of the field's."""
    m = f.metadata
    tp, _optional = field_type(cls, f)
    flag = "--" + f.name.replace("_", "-")
    default = f.default if default is dataclasses.MISSING else default
    if tp is bool:
        g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=m["help"])
        for alias in m.get("aliases", ()):
            g.add_argument(
                alias,
                dest=f.name,
                action="store_const",
                const=not default,
                default=argparse.SUPPRESS,
                help=f"same as {'--no-' + flag[2:] if default else flag}",
            )
        return
    kwargs: dict = {"dest": f.name, "default": default, "help": m["help"]}
    choices = m.get("choices")
    if choices is not None:
        kwargs["choices"] = [c for c in choices if c is not None]
    elif tp in (int, float):
        kwargs["type"] = typed(f, tp, cls)
        kwargs["metavar"] = "N" if tp is int else "X"
    g.add_argument(flag, *m.get("aliases", ()), **kwargs)


def add_fields(g, cls: type, names: Iterable[str] | None = None) -> None:
    """``cls``'s fields (or those named, in that order) as options on ``g``."""
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for name in names if names is not None else by_name:
        add_field_option(g, cls, by_name[name])


def choice_list(name: str, choices: tuple[str, ...]):
    """An argparse type for a comma-separated list of ``choices`` (``lru,lfu``: run each and compare)."""

    def parse(text: str) -> list[str]:
        out = [p.strip() for p in text.split(",") if p.strip()]
        bad = [p for p in out if p not in choices]
        if not out or bad:
            raise argparse.ArgumentTypeError(
                f"--{name.replace('_', '-')} takes {', '.join(choices)} (or a comma-separated list), got {text!r}"
            )
        return out

    parse.__name__ = "list"
    return parse
