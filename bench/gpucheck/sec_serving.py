"""Section serving: ``bench/serve_load.py`` against the 7B-shape model on the card.

The OpenAI-compatible server over random Llama-2-7B weights (fp16), a pool small enough that requests
preempt each other (512 blocks of 16 tokens for 16 clients), 200 requests, 70% streaming, 20% leaving
mid-way: none lost, none doubled, no block leaked, the audit clean; requests a second and time to first
token. The oracle (a fresh engine's ``LLM.generate``) is compared too, but in fp16 a batch's size changes
the matrix kernels' rounding, and random weights' near-ties flip on it: differences are counted, not failed.
"""

from __future__ import annotations

from .shared import Ctx, Section, Table, random_native


def run(ctx: Ctx, section: Section) -> None:
    from serve_load import make_plans, serve_under_load

    from engine import LLMEngine

    model = random_native(ctx.big, ctx.dtype, ctx.device)
    vocab = model.lm_head.weight.shape[0]
    n, clients, max_out = ctx.n(200, 24), ctx.n(16, 4), ctx.n(64, 12)
    config = dict(
        block_size=16, num_gpu_blocks=ctx.n(512, 48), max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024
    )
    row = serve_under_load(
        lambda: LLMEngine.from_model(model, None, name="random-llama-2-7b", **config),
        make_plans(n, seed=0, max_out=max_out, vocab=vocab),
        clients,
    )
    section.tables.append(
        Table(
            f"{n} requests from {clients} clients (70% streaming, 20% leaving mid-way), random Llama-2-7B weights "
            f"(fp16), a {config['num_gpu_blocks']}-block pool",
            [
                ("stayed", "answered", "d"),
                ("left", "left", "d"),
                ("lost", "lost", "d"),
                ("doubled", "doubled", "d"),
                ("leaked_blocks", "leaked", "d"),
                ("preemptions", "preemptions", "d"),
                ("req_s", "req/s", ".1f"),
                ("out_tok_s", "out tok/s", ",.0f"),
                ("ttft_p50_s", "TTFT p50 s", ".3f"),
                ("ttft_p99_s", "TTFT p99 s", ".3f"),
                ("wrong_outputs", "differ from a fresh engine", "d"),
            ],
            [row],
        )
    )
    section.data.update(row)
    for key in ("lost", "doubled", "leaked_blocks"):
        section.check(key.replace("_", " "), row[key], "0", row[key] == 0)
    section.check("audit at the end", "clean" if row["audit_ok"] else "problems", "clean", row["audit_ok"])
    left = row["requests_left_in_engine"]
    section.check("requests left in the engine", left, "0", left == 0)
    if row["errors_text"]:
        section.notes.append("Errors: " + "; ".join(row["errors_text"]))
