"""The probe wire's constants, importable without msgspec or ZeroMQ (``kvscope --help`` lists the faults)."""

# 2: KV cache groups, connector pins (the fields added at the ends of the messages); 3: Step.nulled; 4: a decode
# batch's tokens column by column (Step.run_ids, run_tokens, run_computed); 5: the ops carry vLLM's block keys as
# bytes, which the subscriber splits
PROTOCOL = 5
ENV_ENDPOINT = "KVSCOPE_PROBE_ENDPOINT"
ENV_FAULT = "KVSCOPE_PROBE_FAULT"
ENV_ANY_RELEASE = "KVSCOPE_PROBE_ANY_RELEASE"  # try a vLLM release the probe was not checked against
# What a subscriber may do besides watching: both off unless vLLM's environment switches them on (security.py).
ENV_CONTROL = "KVSCOPE_PROBE_CONTROL"  # =1: pause, step and run vLLM's scheduler
ENV_REMOTE_FAULTS = "KVSCOPE_PROBE_REMOTE_FAULTS"  # =1: switch faults on from a subscriber (tests only)
# CURVE keys (``python -m kvscope_vllm_probe.keys DIR`` makes them): needed to bind anything but loopback.
ENV_SECRET_KEY = "KVSCOPE_PROBE_SECRET_KEY"  # the probe's own secret certificate file
ENV_AUTHORIZED_KEYS = "KVSCOPE_PROBE_AUTHORIZED_KEYS"  # a folder of the public certificates let in
# Data parallel: each rank's probe at its own endpoint (endpoints.rank_endpoint); how many ranks vLLM runs (the
# plugin sets it where vLLM starts its engine cores, which no longer know it; set it by hand for Ray or many nodes).
ENV_DP_SIZE = "KVSCOPE_PROBE_DP_SIZE"
HEARTBEAT_S = 1.0  # a subscriber's heartbeat period
SILENT_S = 5.0  # a peer silent this long is gone (and so is any pause it holds)

# Ops of a Step, each a list whose first item is the code. They are vLLM's own pool operations, in order.
OP_REF = 0  # [0, block, ref_cnt]: a block's ref count became this
# [1, block, key | None, token ids, parent | None]: a block was hashed (stored) under vLLM's key (bytes: the hash,
# then the KV cache group's id in 4; wire.hash64, wire.group_of), or its hash cleared; parent: the request's block
# hash before it (bytes, no group id; wire.parent64)
OP_HASH = 1
OP_POP = 2  # [2, [blocks]]: taken from the free queue's head (get_new_blocks)
OP_REMOVE = 3  # [3, block]: taken from the middle of the free queue (a prefix hit on a free cached block)
OP_APPEND = 4  # [4, [blocks]]: joined the free queue's tail, in this order
OP_PREPEND = 5  # [5, [blocks]]: joined the free queue's head, in this order (the first is the new head)
OP_REQUEST = 6  # [6, request id]: the ops after this one are done for this request ("" for none)
OP_MAP_INSERT = 7  # [7, key, block]: the prefix cache's hash map gained this entry (key: vLLM's bytes, as OP_HASH's)
OP_MAP_POP = 8  # [8, key, block]: the hash map lost this entry
OP_MAP_CLEAR = 9  # [9]: the hash map was emptied (reset_prefix_cache)
FAULTS = ("leak-last-block",)  # the faults the probe can switch on (see faults.py)
