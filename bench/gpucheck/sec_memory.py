"""Section memory: the pool plan kvscope computes and shows, against what the card reports once the pool is full.

Random Llama-2-7B weights in fp16 at ``--gpu-memory-utilization 0.9``: the plan (weights, other tensors,
activation peak, CUDA graphs, memory held elsewhere, KV pool = N blocks); then requests whose prompts need
more blocks than the pool has run until it is full (preempting each other), nvml read after every step:
its peak within 2% of the card that the plan allows (total x 0.9), never an out-of-memory error; the
memory kvscope's memory panel shows (``kvscope.sysinfo.MemoryProbe``) equal to pynvml's and
``torch.cuda.mem_get_info``'s within 1% of the card.
"""

from __future__ import annotations

import torch

from engine.messages import one_line

from .shared import Ctx, Section, Table, random_native, sync

GiB = 2**30


def nvml_used() -> tuple[int, int] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        return int(info.used), int(info.total)
    except Exception:  # noqa: BLE001 - no driver (the dry run)
        return None


def run(ctx: Ctx, section: Section) -> None:
    from engine import LLMEngine, SamplingParams
    from kvscope.sysinfo import MemoryProbe

    dev = ctx.device
    model = random_native(ctx.big, ctx.dtype, dev)
    kw = dict(
        max_num_seqs=64,
        max_model_len=4096 if not ctx.dry_run else 512,
        block_size=16,
        max_num_batched_tokens=8192 if not ctx.dry_run else 256,
    )
    if ctx.dry_run:
        kw["num_gpu_blocks"] = 64  # no CUDA: the plan is CUDA's; the rest runs as on the card
    engine = LLMEngine.from_model(model, None, name="random llama-2-7b", gpu_memory_utilization=0.9, **kw)
    plan = engine.runner.pool_plan
    graphs = engine.runner.decode_graphs
    n_blocks = engine.pool.num_blocks
    prompt = min(kw["max_model_len"] - 96, n_blocks * 16 // 12)  # a dozen requests fill the pool at least
    n_req = n_blocks * 16 // prompt + 4  # more than the pool holds at once
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for _ in range(n_req):
        engine.add_request(torch.randint(1, engine.vocab_size, (prompt,), generator=g).tolist(), params)
    peak_nvml, peak_usage, steps, oom = 0, 0.0, 0, None
    try:
        while engine.has_unfinished() and ctx.left_s() > 10:
            out = engine.step()
            steps += 1
            if out.error:
                oom = out.error
                break
            peak_usage = max(peak_usage, engine.pool.usage())
            if dev.type == "cuda":
                sync(dev)
                nv = nvml_used()
                if nv:
                    peak_nvml = max(peak_nvml, nv[0])
    except torch.cuda.OutOfMemoryError as e:
        oom = one_line(e)
    m = engine.metrics()
    section.check(
        "out-of-memory errors and failed steps",
        oom or m["num_failed_steps"],
        "none",
        oom is None and m["num_failed_steps"] == 0,
    )
    section.check("pool filled (peak blocks in use)", f"{peak_usage:.0%}", ">= 95%", peak_usage >= 0.95)
    pool_gib = n_blocks * engine.runner.block_bytes / GiB
    rows = [
        {"what": "KV pool", "value": f"{n_blocks:,} blocks of 16 tokens = {pool_gib:.2f} GiB"},
        {
            "what": "fill run",
            "value": f"{n_req} requests of {prompt} tokens, {steps} steps, "
            f"{m['num_preemptions']} preemptions, peak usage {peak_usage:.1%}",
        },
    ]
    if plan is not None:
        rows = [
            {
                "what": "card (total)",
                "value": f"{plan.total_bytes / GiB:.2f} GiB x {plan.utilization} = "
                f"{plan.planned_bytes / GiB:.2f} GiB planned",
            },
            {"what": "weights", "value": f"{plan.weights_bytes / GiB:.2f} GiB"},
            {"what": "other tensors", "value": f"{plan.held_bytes / GiB:.2f} GiB"},
            {"what": "activation peak (profiled)", "value": f"{plan.activation_peak_bytes / GiB:.2f} GiB"},
            {
                "what": "CUDA graphs",
                "value": f"{plan.graph_bytes / GiB:.2f} GiB estimated, "
                f"{(graphs.pool_bytes if graphs else 0) / GiB:.2f} GiB at capture",
            },
            {"what": "held elsewhere (context, others)", "value": f"{plan.other_bytes / GiB:.2f} GiB"},
        ] + rows
        section.notes.append(f"The plan as kvscope logs it: {plan.describe()}")
    nv = nvml_used()
    if dev.type == "cuda" and nv and plan is not None:
        used, total = nv
        diff = (peak_nvml - plan.planned_bytes) / total
        rows.append(
            {
                "what": "nvml at the fill's peak",
                "value": f"{peak_nvml / GiB:.2f} GiB ({diff:+.2%} of the card against the plan)",
            }
        )
        section.check(
            "nvml peak against the plan (total x 0.9)", f"{diff:+.2%}", "within 2% of the card", abs(diff) <= 0.02
        )
        probe = MemoryProbe.for_device("cuda").read()
        free_t, total_t = torch.cuda.mem_get_info()
        nv_used, nv_total = nvml_used()
        shown_free = probe.device_free
        rows += [
            {
                "what": "kvscope shows (memory panel)",
                "value": f"used {probe.nvml_used / GiB:.2f} of "
                f"{probe.nvml_total / GiB:.2f} GiB, free {shown_free / GiB:.2f} GiB",
            },
            {
                "what": "pynvml",
                "value": f"used {nv_used / GiB:.2f} of {nv_total / GiB:.2f} GiB, "
                f"free {(nv_total - nv_used) / GiB:.2f} GiB",
            },
            {"what": "torch.cuda.mem_get_info", "value": f"free {free_t / GiB:.2f} of {total_t / GiB:.2f} GiB"},
        ]
        section.check(
            "shown used against pynvml",
            f"{(probe.nvml_used - nv_used) / nv_total:+.2%}",
            "within 1%",
            abs(probe.nvml_used - nv_used) <= 0.01 * nv_total,
        )
        section.check(
            "shown free against mem_get_info",
            f"{(shown_free - free_t) / total_t:+.2%}",
            "within 1%",
            abs(shown_free - free_t) <= 0.01 * total_t,
        )
        section.data.update(plan_planned=plan.planned_bytes, nvml_peak=peak_nvml, total=total)
    section.tables.append(
        Table("The plan, and the card once the pool is full", [("what", "", ""), ("value", "", "")], rows)
    )
