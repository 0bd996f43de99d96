"""A request's state in words a person reads ("finished: max tokens", not ``finished_length``), and vLLM's own
word for it in the tooltip. One table for the requests table, the paper's figure and the presentation's status.

The rows carry kvscope's status names, which follow vLLM's ``RequestStatus`` (``vllm/v1/request.py``); a probed
vLLM's rows are mapped into them by the probe's mirror. vLLM's own names are accepted too, so a row that keeps
vLLM's word reads the same.
"""

from __future__ import annotations

# status -> (the words shown, vLLM's RequestStatus name and finish_reason, what it means)
WORDS: dict[str, tuple[str, str, str]] = {
    "WAITING": ("waiting", "WAITING", "in the waiting queue: not admitted yet, no blocks"),
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": (
        "waiting: grammar",
        "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR",
        "waits for its structured-output grammar to compile",
    ),
    "WAITING_FOR_REMOTE_KVS": ("waiting: remote KV", "WAITING_FOR_REMOTE_KVS", "waits for KV from another instance"),
    "WAITING_FOR_STREAMING_REQ": ("waiting: streamed input", "WAITING_FOR_STREAMING_REQ", "waits for more input"),
    "RUNNING": ("running", "RUNNING", "scheduled: its blocks hold its KV"),
    "PREEMPTED": (
        "preempted: recompute",
        "PREEMPTED",
        "its blocks were freed; its prompt and output are prefilled again when it is admitted",
    ),
    "SWAPPED": (
        "preempted: swapped out",
        "SWAPPED (vLLM v0; v1 preempts by recompute only)",
        "its KV was copied to the CPU swap pool and comes back when blocks are free",
    ),
    "FINISHED_STOPPED": (
        "finished: stop",
        'FINISHED_STOPPED, finish_reason "stop"',
        "an end-of-sequence token or a stop string",
    ),
    "FINISHED_LENGTH": (
        "finished: max tokens",
        'FINISHED_LENGTH_CAPPED, finish_reason "length"',
        "max_tokens reached (or the model's length)",
    ),
    "FINISHED_LENGTH_CAPPED": (
        "finished: max tokens",
        'FINISHED_LENGTH_CAPPED, finish_reason "length"',
        "max_tokens reached (or the model's length)",
    ),
    "FINISHED_ABORTED": ("finished: aborted", 'FINISHED_ABORTED, finish_reason "abort"', "aborted by its client"),
    "FINISHED_ERROR": ("finished: error", 'FINISHED_ERROR, finish_reason "error"', "a request-level error"),
    "FINISHED_IGNORED": (
        "finished: prompt too long",
        'FINISHED_IGNORED, finish_reason "length"',
        "its prompt is longer than the model's length",
    ),
    "FINISHED_REPETITION": (
        "finished: repetition",
        'FINISHED_REPETITION, finish_reason "repetition"',
        "a repetitive pattern was detected",
    ),
    "FINISHED_PRUNED": (
        "finished: pruned beam",
        "no vLLM word (kvscope's beam search: vLLM searches beams outside its engine)",
        "a beam that no continuation chose",
    ),
}
WIDEST = max((w for w, _, _ in WORDS.values()), key=len)  # what the requests table's state column must hold


def status_words(status: str) -> str:
    """The state as a person reads it."""
    known = WORDS.get(status.upper())
    return known[0] if known else status.lower().replace("_", " ")


def status_tip(status: str) -> str:
    """vLLM's own word for the state, and what it means (a tooltip)."""
    known = WORDS.get(status.upper())
    if known is None:
        return f"vLLM: {status}"
    return f"{known[0]}: {known[2]}. vLLM: {known[1]}"
