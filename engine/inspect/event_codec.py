"""Events packed as msgpack bytes, for a history that keeps many steps (the window's timeline).

An event object with its token tuple, hash strings and int objects takes about 1 KB; packed (a kind
code and the field values, in field order) it takes 50-200 bytes. ``unpack_events`` builds the same
events again (equal to the originals), for a scrub that replays a few hundred steps.
"""
from __future__ import annotations

import typing
from dataclasses import fields

import msgspec

from .events import EVENT_TYPES, Event

PACKED_TYPES: list[type[Event]] = list(EVENT_TYPES.values())  # a row's code indexes this
_TYPES = PACKED_TYPES
_CODE = {cls: i for i, cls in enumerate(_TYPES)}
_NAMES = {cls: tuple(f.name for f in fields(cls)) for cls in _TYPES}
# per type, the positions of tuple fields: msgpack arrays come back as lists
_TUPLES = {cls: tuple(i for i, f in enumerate(fields(cls))
                      if typing.get_origin(typing.get_type_hints(cls)[f.name]) is tuple) for cls in _TYPES}
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def pack_events(events: list[Event]) -> bytes:
    return _encoder.encode([(_CODE[type(e)], *[getattr(e, n) for n in _NAMES[type(e)]]) for e in events])


def decode_rows(data: bytes) -> list[list]:
    """The packed rows as they are: ``[code, *fields]``, a code indexing ``EVENT_TYPES``'s values and
    tuple fields as lists (``PoolReplayer.apply_packed`` reads them without building events)."""
    return _decoder.decode(data)


def unpack_events(data: bytes) -> list[Event]:
    out = []
    for item in _decoder.decode(data):
        cls = _TYPES[item[0]]
        values = item[1:]
        for i in _TUPLES[cls]:
            values[i] = tuple(values[i])
        out.append(cls(*values))
    return out
