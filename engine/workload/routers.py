"""The router in front of a simulated fleet: which instance each arriving request goes to.

One small class per policy, each standing for a production router (its docstring says which, and how
it differs). A router sees what a real one sees when a request arrives:

- each instance's queue: ``load()`` is its running plus waiting requests (vLLM's
  ``num_requests_running`` + ``num_requests_waiting``), ``waiting()`` the waiting ones alone;
- for the prefix-aware policies, each instance's cached blocks: ``cached_prefix(hashes)`` reads the
  instance's own pool (its hash map) for the longest run of the request's block hashes, as a precise
  router's index is built from the instance's KV events (block stored, block removed). No separate
  model of the caches: what the router reads is what the instance would hit, up to the blocks evicted
  or computed between the routing and the request's admission.

Ties always go to the instance listed first, so a run is reproducible. Names on the command line are
``ROUTERS``' keys.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol


class Instance(Protocol):
    """What a router may ask of an instance."""

    def load(self) -> int: ...  # running + waiting requests

    def waiting(self) -> int: ...  # waiting requests (not yet admitted, or preempted)

    def cached_prefix(self, block_hashes: Sequence[bytes]) -> int: ...  # leading hashes in its pool


@dataclass(slots=True)
class Arrival:
    """A request as a router sees it: its trace line, its session key, and (for the policies that ask for
    them) its block hashes, the chained hashes of its full blocks up to the last one a hit may cover."""

    line: int
    session: Hashable
    block_hashes: Sequence[bytes] = field(default_factory=tuple)
    hits: list[int] | None = None  # each instance's cached prefix, once a router read them

    def cached_prefixes(self, instances: Sequence[Instance]) -> list[int]:
        """Each instance's cached prefix of this request, in blocks (read once, then remembered)."""
        if self.hits is None:
            self.hits = [inst.cached_prefix(self.block_hashes) for inst in instances]
        return self.hits


class Router:
    """Base: ``choose`` returns the index of the instance that gets the request."""

    name: ClassVar[str] = ""
    needs_hashes: ClassVar[bool] = False  # the fleet hashes a request's blocks before choosing only if so

    def choose(self, arrival: Arrival, instances: Sequence[Instance]) -> int:
        raise NotImplementedError

    def params(self) -> dict:
        """The policy's settings (the JSON says them beside the name)."""
        return {}


def least_loaded(instances: Sequence[Instance], among: Sequence[int] | None = None) -> int:
    """The instance with the fewest running plus waiting requests (the first listed on a tie)."""
    among = range(len(instances)) if among is None else among
    return min(among, key=lambda i: (instances[i].load(), i))


class RoundRobin(Router):
    """Each request to the next instance in turn, whatever it holds or runs.

    Stands for the default of vLLM production-stack's router (``--routing-logic roundrobin``) and of
    NVIDIA Dynamo's frontend (``--router-mode round-robin``), and for a plain Kubernetes Service.
    """

    name = "round-robin"

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, arrival: Arrival, instances: Sequence[Instance]) -> int:
        i = self.turn % len(instances)
        self.turn += 1
        return i


class LeastLoaded(Router):
    """The instance with the fewest requests running plus waiting.

    Stands for a load-only router reading each vLLM's ``num_requests_running`` and
    ``num_requests_waiting``: llm-d's queue and active-request scorers on their own, or Dynamo's KV
    router with ``--kv-overlap-score-weight 0`` (its documented pure load balancing, though Dynamo counts
    active blocks, not requests).
    """

    name = "least-loaded"

    def choose(self, arrival: Arrival, instances: Sequence[Instance]) -> int:
        return least_loaded(instances)


class Session(Router):
    """Every request of a session to the same instance: a stable hash of its session key, modulo N.

    Stands for vLLM production-stack's ``--routing-logic session`` (a session id from a header, on a
    consistent-hash ring) and llm-d's session-affinity scorer (a cookie). A trace has no header: the key is
    the trace's conversation (kvscope's ``session`` field, or for a Mooncake trace its first block id past
    the blocks every request shares; ``session_keys`` in fleet.py).
    """

    name = "session"

    def choose(self, arrival: Arrival, instances: Sequence[Instance]) -> int:
        return zlib.crc32(repr(arrival.session).encode()) % len(instances)


class PrefixAware(Router):
    """The instance whose pool holds the longest prefix of the request's blocks; ties to the least loaded.

    Stands for llm-d's precise prefix-cache scorer alone (its index built from every instance's KV
    events, highest score picked) and for Dynamo's KV router when cache overlap dominates its cost. vLLM
    production-stack's ``prefixaware`` logic picks the same way from a trie of the prompts it routed,
    which cannot see evictions; this reads the pools themselves.
    """

    name = "prefix-aware"
    needs_hashes = True

    def choose(self, arrival: Arrival, instances: Sequence[Instance]) -> int:
        hits = arrival.cached_prefixes(instances)
        best = max(hits)
        return least_loaded(instances, [i for i, h in enumerate(hits) if h == best])


class PrefixLoad(Router):
    """Prefix-aware with a load threshold, scored as llm-d combines its scorers.

    score = ``prefix_weight`` x prefix + ``load_weight`` x load, the highest wins (ties to the least loaded):

    - prefix: the precise prefix-cache scorer's, each instance's cached blocks min-max normalised over the
      fleet (1 for the longest, 0 for the shortest; 1 for all when they are equal);
    - load: llm-d's load-aware scorer's, 0.5 for an empty waiting queue, falling linearly to 0 at
      ``threshold`` waiting requests (an overloaded instance).

    The defaults are llm-d's documented ones (weights 2 and 1, threshold 128): the cache leads, and the
    queue decides between instances whose cached prefixes are close. Dynamo's KV router weighs the same two
    things as one cost (overlap-weighted prefill blocks plus active decode blocks, the lowest wins).
    """

    name = "prefix-load"
    needs_hashes = True

    def __init__(self, prefix_weight: float = 2.0, load_weight: float = 1.0, threshold: int = 128) -> None:
        if threshold < 1:
            raise ValueError(f"the load threshold must be >= 1, got {threshold}")
        self.prefix_weight, self.load_weight, self.threshold = prefix_weight, load_weight, threshold

    def load_score(self, waiting: int) -> float:
        return 0.5 * (1 - min(waiting, self.threshold) / self.threshold)

    def scores(self, arrival: Arrival, instances: Sequence[Instance]) -> list[float]:
        hits = arrival.cached_prefixes(instances)
        lo, hi = min(hits), max(hits)
        prefix = [1.0 if hi == lo else (h - lo) / (hi - lo) for h in hits]
        return [
            self.prefix_weight * p + self.load_weight * self.load_score(inst.waiting())
            for p, inst in zip(prefix, instances)
        ]

    def choose(self, arrival: Arrival, instances: Sequence[Instance]) -> int:
        scores = self.scores(arrival, instances)
        best = max(scores)
        return least_loaded(instances, [i for i, s in enumerate(scores) if s == best])

    def params(self) -> dict:
        return {"prefix_weight": self.prefix_weight, "load_weight": self.load_weight, "threshold": self.threshold}


ROUTERS: dict[str, type[Router]] = {r.name: r for r in (RoundRobin, LeastLoaded, Session, PrefixAware, PrefixLoad)}


def make_router(name: str) -> Router:
    """A fresh router by its command-line name; ``ValueError`` (one line) for an unknown one."""
    cls = ROUTERS.get(name)
    if cls is None:
        raise ValueError(f"--router takes {', '.join(ROUTERS)} (or a comma-separated list), got {name!r}")
    return cls()


def routers_of(text: str) -> list[str]:
    """``--router``'s value: one name or a comma-separated list, each checked."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--router takes {', '.join(ROUTERS)} (or a comma-separated list), got {text!r}")
    for n in names:
        make_router(n)
    return names
