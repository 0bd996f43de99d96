"""A KV connector whose scheduler-side answers a test scripts (``tests/probe_vllm/harness.py``'s ``connector`` op),
for vLLM's real scheduler in the harness: what real connectors do to the pool, without a transfer behind it.

- ``delay_free``: ``request_finished`` keeps the request's blocks (vLLM frees them when the harness reports the
  request in ``finished_sending``, a later step);
- ``load``: request id -> tokens the connector "has": ``get_num_new_matched_tokens`` offers them as an
  asynchronous load (the request waits in WAITING_FOR_REMOTE_KVS with blocks allocated for them until the harness
  reports it in ``finished_recving``, or ``failed_recving`` for a load that fails);
- ``pin``: block ids ``build_connector_meta`` pins with ``touch()`` (a ref with no table behind it, as
  SimpleCPUOffload pins what it copies), released by ``update_connector_output`` once ``unpin`` is set;
- ``second_pool``: a ``BlockPool`` of its own (SimpleCPUOffload's CPU pool is one), whose ``KVCacheBlock``s it
  hands out, touches and frees every step: the probe must record the scheduler's pool only.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


class ScriptedConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.delay_free = False
        self.load: dict[str, int] = {}
        self.pin: list[int] = []
        self.unpin = False
        self.second_pool = None
        self.pool = None  # the scheduler's (bind_kv_cache_manager)
        self.pinned: list = []
        self.delayed: list[str] = []  # requests whose blocks it kept

    # -- the scheduler's side --------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.pool = kv_cache_manager.block_pool

    def make_second_pool(self, num_blocks: int = 16) -> None:
        from vllm.v1.core.block_pool import BlockPool

        self.second_pool = BlockPool(num_blocks, True, self.pool.hash_block_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        n = self.load.pop(request.request_id, 0)
        n = min(n, request.num_tokens - 1 - num_computed_tokens)  # never the last prompt token: it is computed
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self.pin and self.pool is not None:
            blocks = [self.pool.blocks[b] for b in self.pin]
            self.pool.touch(blocks)
            self.pinned += blocks
            self.pin = []
        if self.second_pool is not None:  # its own blocks, through the same KVCacheBlock class
            got = self.second_pool.get_new_blocks(3)
            self.second_pool.touch(got[:1])
            self.second_pool.free_blocks(got + got[:1])
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output) -> None:
        if self.unpin and self.pinned:
            self.pool.free_blocks(self.pinned)
            self.pinned, self.unpin = [], False

    def request_finished(self, request, block_ids):
        return self._finished(request)

    def request_finished_all_groups(self, request, block_ids):
        return self._finished(request)

    def _finished(self, request):
        if self.delay_free:
            self.delayed.append(request.request_id)
            return True, None
        return False, None

    # -- the worker's side (no worker here) ------------------------------------------------------------
    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
