"""The one set of colours and their meanings: the block grid, its legend, the block table, the figures, the plots.

Rules (issue 14): a colour means one thing everywhere. Shared (ref count > 1) is orange in every
view, and higher ref counts are lighter oranges, never the red that only "leaked" uses. "Cached"
always means a free block that still holds its hash: reusable by a prefix hit until it is evicted.
No Qt here, so the headless side and tests may use it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.inspect.snapshot import BlockState, KVSnapshot

RGB = tuple[int, int, int]

BACKGROUND: RGB = (20, 22, 26)  # padding cells after the last block, and cell borders


@dataclass(frozen=True, slots=True)
class ColourClass:
    name: str
    colour: RGB  # fill (grid cells, table cells, swatches)
    meaning: str
    line: RGB | None = None  # a brighter variant for lines on the dark plot background

    @property
    def line_colour(self) -> RGB:
        return self.line or self.colour


STATES: dict[BlockState, ColourClass] = {
    BlockState.FREE: ColourClass("free", (62, 68, 80), "empty, on the free queue", line=(160, 166, 178)),
    BlockState.CACHED: ColourClass(
        "cached", (66, 133, 244), "free but still hashed: reusable by a prefix hit until evicted"
    ),
    BlockState.USED: ColourClass("used", (52, 168, 83), "held by one request (ref count 1)"),
    BlockState.SHARED: ColourClass("shared", (251, 140, 0), "held by several requests (ref count > 1)"),
    BlockState.SWAPPED: ColourClass(
        "swapped", (156, 39, 176), "a CPU block holding a swapped-out request's KV", line=(186, 104, 200)
    ),
    BlockState.LEAKED: ColourClass(
        "audit problem",
        (229, 57, 53),
        "found wrong by the audit: leaked, a wrong ref count, written while shared... (the banner says which)",
    ),
    BlockState.RESERVED: ColourClass(
        "reserved",
        (122, 110, 92),
        "never handed out, not counted as used: vLLM's null block (a table's placeholder for a block given back)",
    ),
}
STATE_COLOURS: dict[BlockState, RGB] = {s: c.colour for s, c in STATES.items()}

# the fragmentation figure's slot classes: every one is held by a request, so every one is a green (the grid's
# "used"): written (the grid's green itself), the empty rest of its last block (dark), reserved ahead (pale).
# No orange (the grid's "shared") and no grey (the grid's "free"): a slot held by a request is neither.
FRAGMENTS: dict[str, ColourClass] = {
    "used": ColourClass("used", (52, 168, 83), "holds the KV of a computed token"),
    "wasted": ColourClass(
        "wasted inside a block",
        (24, 92, 46),
        "the rest of a request's last block: internal fragmentation, under one block a request",
    ),
    "reserved": ColourClass(
        "reserved, empty", (168, 218, 176), "held for tokens the request may still produce: the max-length reservation"
    ),
}

# The fleet window outlines the instance that got the latest request: white, a colour no block state has.
ROUTE_HIGHLIGHT: RGB = (255, 255, 255)

# A hybrid model's KV cache groups (a probed vLLM's): one colour each, by group id, in the "KV group" mode. Clear
# of the state hues (no green, orange, blue or red) and of each other: the eye tells which group holds a block.
GROUP_COLOURS: list[RGB] = [(0, 188, 212), (255, 202, 40), (236, 64, 122), (124, 179, 66), (171, 71, 188)]


def group_colour(g: int) -> RGB:
    return GROUP_COLOURS[g % len(GROUP_COLOURS)]


FREE = STATE_COLOURS[BlockState.FREE]
RESERVED = STATE_COLOURS[BlockState.RESERVED]
CACHED = STATE_COLOURS[BlockState.CACHED]
USED = STATE_COLOURS[BlockState.USED]
SHARED = STATE_COLOURS[BlockState.SHARED]
SWAPPED = STATE_COLOURS[BlockState.SWAPPED]
LEAKED = STATE_COLOURS[BlockState.LEAKED]

# Ref count 0, 1, 2, 3, 4+: free grey, used green, then ever lighter oranges (shared), never red.
REF_COLOURS: list[RGB] = [FREE, USED, SHARED, (255, 183, 77), (255, 224, 130)]
REF_NAMES = ["ref 0 (free or cached)", "ref 1", "ref 2", "ref 3", "ref ≥ 4"]


# One colour per request (by its index, modulo the palette). No reds (leaked), and the first ones
# keep clear of the state hues, so that request A and B in the figure view are not read as states.
OWNER_PALETTE: list[RGB] = [
    (38, 198, 218),
    (244, 143, 177),
    (212, 225, 87),
    (161, 136, 127),
    (255, 241, 118),
    (0, 150, 136),
    (197, 202, 233),
    (255, 204, 128),
    (158, 157, 36),
    (141, 110, 99),
    (129, 212, 250),
    (206, 147, 216),
]


def owner_colour(index: int) -> RGB:
    return OWNER_PALETTE[index % len(OWNER_PALETTE)]


# A fleet's instances (the fleet window): one colour each, by its place in the fleet, from the owners' palette
# (an identity, clear of the state hues); a fleet window shows no requests, so the two never meet on one screen.
def instance_colour(index: int) -> RGB:
    return OWNER_PALETTE[index % len(OWNER_PALETTE)]


ROUTE_PATH: RGB = (255, 255, 255)  # the fleet forest: the blocks of the prompt being routed, ringed
DOWN: RGB = LEAKED  # an instance that went away, lost batches or cannot be scored: wrong, as an audit problem is


# Age = steps since a block was last allocated, touched or freed, in doubling bins.
AGE_BINS: list[tuple[int, int | None]] = [(0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, None)]
AGE_COLOURS: list[RGB] = [
    (255, 241, 118),
    (255, 213, 79),
    (255, 167, 38),
    (239, 124, 60),
    (196, 92, 72),
    (141, 72, 82),
    (95, 58, 82),
    (62, 52, 72),
]


def age_name(i: int) -> str:
    lo, hi = AGE_BINS[i]
    if hi is None:
        return f"≥ {lo} steps ago"
    return ("this step" if lo == 0 else "1 step ago") if lo == hi else f"{lo}–{hi} steps ago"


def age_codes(age: np.ndarray) -> np.ndarray:
    """Bin index (uint8) of each age in steps."""
    edges = np.array([lo for lo, _ in AGE_BINS[1:]])
    return np.searchsorted(edges, np.maximum(age, 0), side="right").astype(np.uint8)


# Time-series curves (kvscope/ui/views/plots.py): block curves take their state's colour.
SERIES_COLOURS: dict[str, RGB] = {
    "free": STATES[BlockState.FREE].line_colour,
    "cached": CACHED,
    "used": USED,
    "shared": SHARED,
    "hit_rate": (130, 177, 255),  # the prefix cache's success: a light "cached" blue
    "evictions_per_s": (255, 138, 101),  # a cached block lost: no state colour (orange is shared, red a problem)
    "running": USED,
    "waiting": (224, 224, 224),
    "swapped": STATES[BlockState.SWAPPED].line_colour,
    "tokens_per_s": (38, 198, 218),
    "decode_tokens_per_s": (255, 202, 40),
    "ttft": (240, 98, 146),
    "pool_bytes": (100, 181, 246),
    "pool_used": USED,
    "device_free": (255, 241, 118),
    "process_rss": (176, 176, 176),
    "nvml_used": (255, 255, 255),
    "torch_allocated": (128, 203, 196),
    "torch_reserved": (149, 117, 205),
}


def text_on(colour: RGB) -> RGB:
    """Black or white, whichever reads better on ``colour``."""
    r, g, b = colour
    return (0, 0, 0) if 0.299 * r + 0.587 * g + 0.114 * b > 140 else (255, 255, 255)


def hex_colour(c: RGB) -> str:
    return "#{:02x}{:02x}{:02x}".format(*c)


# -- classes of a snapshot for a colour mode (the grid's codes and the legend's rows) ------------

MODES = ("state", "owner", "ref count", "age", "KV group")
MAX_OWNERS_LISTED = 8  # the legend lists the biggest owners by name, the rest as "others"


@dataclass(frozen=True, slots=True)
class LegendEntry:
    name: str
    colours: tuple[RGB, ...]  # one swatch colour, or several (e.g. "others" in owner mode)
    count: int  # blocks of this class in the snapshot
    meaning: str = ""


def block_state(snap: KVSnapshot, block_id: int, flagged=()) -> ColourClass:
    """Block ``block_id``'s colour class as the grid draws it in state mode: the audit's where the audit
    flagged it, else its state's. Every view that colours one block by its state asks here."""
    if block_id in flagged:
        return STATES[BlockState.LEAKED]
    return STATES[BlockState(int(snap.state[block_id]))]


def state_codes(snap: KVSnapshot, leaked: np.ndarray | None = None) -> np.ndarray:
    codes = snap.state.copy()
    if leaked is not None and len(leaked):
        codes[np.asarray(leaked, np.int64)] = BlockState.LEAKED
    return codes


def legend_entries(
    snap: KVSnapshot, mode: str, leaked: np.ndarray | None = None, cpu: bool = False, flag_name: str | None = None
) -> list[LegendEntry]:
    """Every class of ``mode`` with its colour(s) and its count of blocks in ``snap``. ``flag_name``: what the
    audit's flagged blocks are (its kinds, e.g. "written while shared"), the red class's name when there are any."""
    state, owner = (snap.cpu_state, snap.cpu_owner) if cpu else (snap.state, snap.owner)
    if mode == "state":
        counts = np.bincount(state, minlength=len(BlockState))
        if not cpu and leaked is not None and len(leaked):  # leaked blocks count as leaked, not as their state
            ids = np.unique(np.asarray(leaked, np.int64))
            counts -= np.bincount(state[ids], minlength=len(BlockState))
            counts[BlockState.LEAKED] += len(ids)
        shown = (
            [BlockState.FREE, BlockState.SWAPPED]
            if cpu
            else [BlockState.FREE, BlockState.CACHED, BlockState.USED, BlockState.SHARED, BlockState.LEAKED]
        )
        if not cpu and counts[BlockState.RESERVED]:  # a probed vLLM's null block: its own row, never "used"
            shown.append(BlockState.RESERVED)

        def name(s: BlockState) -> str:
            return flag_name if s is BlockState.LEAKED and flag_name and counts[s] else STATES[s].name

        return [LegendEntry(name(s), (STATES[s].colour,), int(counts[s]), STATES[s].meaning) for s in shown]
    if mode == "owner":
        by_index = {r.index: r.request_id for r in snap.requests}
        owned = owner[owner >= 0]
        idx, cnt = np.unique(owned, return_counts=True)
        order = sorted(zip(cnt.tolist(), idx.tolist()), key=lambda t: (-t[0], t[1]))
        entries = [LegendEntry("no owner", (FREE,), int((owner < 0).sum()), "free or cached: no request holds it")]
        for c, i in order[:MAX_OWNERS_LISTED]:
            entries.append(
                LegendEntry(
                    f"request {by_index.get(i, f'#{i}')}",
                    (owner_colour(i),),
                    int(c),
                    "blocks whose first holder is this request (shared ones too)",
                )
            )
        rest = order[MAX_OWNERS_LISTED:]
        if rest:
            colours = tuple(dict.fromkeys(owner_colour(i) for _, i in rest))[:4]
            entries.append(LegendEntry(f"others ({len(rest)} requests)", colours, sum(c for c, _ in rest)))
        return entries
    if mode == "ref count":
        if cpu:
            return legend_entries(snap, "state", cpu=True)
        counts = np.bincount(np.minimum(snap.ref_cnt, len(REF_COLOURS) - 1), minlength=len(REF_COLOURS))
        return [LegendEntry(n, (c,), int(k)) for n, c, k in zip(REF_NAMES, REF_COLOURS, counts)]
    if mode == "KV group":
        if cpu:
            return legend_entries(snap, "state", cpu=True)
        codes = group_codes(snap)
        counts = np.bincount(codes, minlength=2 + max(snap.num_groups, 1))
        labels = [g.label() for g in snap.kv_groups]
        entries = [LegendEntry("no group", (FREE,), int(counts[0]), "free and unhashed: no group holds or caches it")]
        if snap.reserved:
            entries.append(LegendEntry("reserved", (RESERVED,), int(counts[1]), STATES[BlockState.RESERVED].meaning))
        for g in range(max(snap.num_groups, 1)):
            name = f"group {g}" + (f": {labels[g]}" if g < len(labels) else "")
            entries.append(
                LegendEntry(
                    name, (group_colour(g),), int(counts[2 + g]), "held by this group's tables, or cached in it"
                )
            )
        return entries
    if mode == "age":
        if cpu:
            return legend_entries(snap, "state", cpu=True)
        counts = np.bincount(age_codes(snap.step - snap.last_access), minlength=len(AGE_BINS))
        return [
            LegendEntry(age_name(i), (AGE_COLOURS[i],), int(counts[i]), "since last allocated, hit or freed")
            for i in range(len(AGE_BINS))
        ]
    raise ValueError(f"unknown colour mode {mode!r}")


def group_codes(snap: KVSnapshot) -> np.ndarray:
    """The "KV group" mode's code of each block: 0 no group, 1 reserved, 2 + g group g (one group: every block
    held or cached is group 0's)."""
    if len(snap.block_group):
        codes = (snap.block_group.astype(np.int16) + 2).astype(np.uint8)  # NO_GROUP (-1) -> 1, fixed below
        codes[snap.block_group < 0] = 0
    else:
        codes = np.where((snap.state == BlockState.FREE), 0, 2).astype(np.uint8)
    if snap.reserved:
        codes[list(snap.reserved)] = 1
    return codes


def group_lut_colours(num_groups: int) -> list[RGB]:
    """The "KV group" mode's colours, by code (group_codes)."""
    return [FREE, RESERVED] + [group_colour(g) for g in range(max(num_groups, 1))]
