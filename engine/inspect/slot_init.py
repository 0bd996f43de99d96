"""A faster ``__init__`` for frozen, slotted dataclasses that are made by the thousand.

A frozen dataclass's generated ``__init__`` sets every field through ``object.__setattr__``: about
1 µs for a two-field event, 4.6 µs for a snapshot row of fifteen. Writing through the slot
descriptors instead halves that, and the class stays frozen to everyone else (assignment still
raises ``FrozenInstanceError``; equality, hashing, pickling and ``repr`` are the dataclass's own).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any


def slot_init(cls: type) -> type:
    """Replace ``cls.__init__`` (a frozen ``slots=True`` dataclass without ``__post_init__`` or
    default factories) with one that writes the slots directly; returns ``cls``."""
    ns: dict[str, Any] = {}
    params, body = [], []
    for f in fields(cls):
        if f.default_factory is not MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: slot_init does not handle default factories")
        ns[f"_set_{f.name}"] = getattr(cls, f.name).__set__
        if f.default is MISSING:
            params.append(f.name)
        else:
            ns[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        body.append(f"    _set_{f.name}(self, {f.name})")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has __post_init__: slot_init would skip it")
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body or ["    pass"]), ns)  # noqa: S102
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    setattr(cls, "__init__", init)  # noqa: B010 - a class's __init__ replaced on purpose
    return cls
