"""Faults the probe can switch on inside vLLM, for tests and for teaching how a leak is found.

``leak-last-block``: the next finished request's last block is taken out of its table just before vLLM frees
the table, so its free never happens: the block keeps ref count 1 and no table holds it, which is exactly
what an abort or disconnect path that forgets one block leaves behind. It fires once each time it is
switched on (``KVSCOPE_PROBE_FAULT=leak-last-block`` at start, or a ``SetFault`` from a subscriber). In a hybrid
model it takes the block from the first full-attention group's table (the group that holds every token), else
from group 0's.
"""

from __future__ import annotations

import logging

from .groups import kind_of
from .wire import FAULTS

logger = logging.getLogger("kvscope_vllm_probe")


class Faults:
    def __init__(self, manager) -> None:
        self.manager = manager
        self.armed: set[str] = set()
        self.fired: list[tuple[str, int]] = []  # (request id, block) leaked so far
        managers = manager.coordinator.single_type_managers
        self.group = next((g for g, m in enumerate(managers) if kind_of(m) == "full"), 0)

    def set(self, name: str, on: bool) -> None:
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}: the probe knows {', '.join(FAULTS)}")
        (self.armed.add if on else self.armed.discard)(name)

    @property
    def name(self) -> str:
        return ",".join(sorted(self.armed))

    def before_free(self, request) -> None:
        """The recorder calls this before ``KVCacheManager.free(request)``."""
        if "leak-last-block" not in self.armed or not request.is_finished():
            return
        table = self.manager.coordinator.single_type_managers[self.group].req_to_blocks.get(request.request_id)
        if not table or table[-1].is_null:
            return
        block = table.pop()  # vLLM frees what the table holds: this one is now held by nobody
        self.armed.discard("leak-last-block")
        self.fired.append((request.request_id, block.block_id))
        logger.warning(
            "kvscope probe: fault leak-last-block: block %d of request %s will not be freed (KV cache group %d)",
            block.block_id,
            request.request_id,
            self.group,
        )
