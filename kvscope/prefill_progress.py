"""A long prompt's prefill in progress, in one line: the window's status bar and headless say the same.

A prompt longer than the step's token budget (``max_num_batched_tokens``) is prefilled in chunks, one a
step; on a CPU a 30 KB prompt takes a minute, and without this line nothing on screen moves meanwhile.
"""

from __future__ import annotations


def prefill_progress(snap) -> str | None:
    """ "prefilling request 3: 4,096 of 7,531 prompt tokens (54%)" for each request part way through its
    prompt (some tokens computed, not all), or None when no prefill spans steps."""
    parts = []
    for r in snap.requests:
        done, total = r.num_computed_tokens, r.num_prompt_tokens
        if 0 < done < total and r.status.upper() == "RUNNING":
            parts.append(f"request {r.request_id}: {done:,} of {total:,} prompt tokens ({100 * done // total}%)")
    return f"prefilling {', '.join(parts)}" if parts else None
