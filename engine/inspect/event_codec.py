"""Events packed as msgpack bytes, for a history that keeps many steps (the window's timeline).

An event object with its token tuple, hash strings and int objects takes about 1 KB; packed (a kind
code and the field values, in field order) it takes 50-200 bytes. ``unpack_events`` builds the same
events again (equal to the originals), for a scrub that replays a few hundred steps.
"""

from __future__ import annotations

import typing
from dataclasses import fields
from operator import attrgetter

import msgspec

from .events import EVENT_TYPES, Event

PACKED_TYPES: list[type[Event]] = list(EVENT_TYPES.values())  # a row's code indexes this
_CODE = {cls: i for i, cls in enumerate(PACKED_TYPES)}


def _getter(cls: type[Event]):
    names = [f.name for f in fields(cls)]
    if len(names) == 1:  # attrgetter of one name returns the value, not a 1-tuple
        one = attrgetter(names[0])
        return lambda ev: (one(ev),)
    return attrgetter(*names)


# an event's field values in field order, in one C call: what a packed row holds after its code
FIELDS_OF = {cls: _getter(cls) for cls in PACKED_TYPES}
# per type, the positions of tuple fields: msgpack arrays come back as lists
_TUPLES = {
    cls: tuple(i for i, f in enumerate(fields(cls)) if typing.get_origin(typing.get_type_hints(cls)[f.name]) is tuple)
    for cls in PACKED_TYPES
}
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def pack_events(events: list[Event]) -> bytes:
    return _encoder.encode([(_CODE[type(e)], *FIELDS_OF[type(e)](e)) for e in events])


def packed_rows(data: bytes) -> list[list]:
    """The packed rows as they are: ``[code, *fields]``, a code indexing ``EVENT_TYPES``'s values and
    tuple fields as lists (``PoolReplayer.apply_packed`` reads them without building events)."""
    return _decoder.decode(data)


def unpack_events(data: bytes) -> list[Event]:
    out = []
    for item in _decoder.decode(data):
        cls = PACKED_TYPES[item[0]]
        values = item[1:]
        for i in _TUPLES[cls]:
            values[i] = tuple(values[i])
        out.append(cls(*values))
    return out
