"""Ready-made requests for the Inject dialog (chat messages or plain text)."""

from __future__ import annotations

SYSTEM_PROMPT = (
    "You are KV, a patient teaching assistant for an operating-systems course. You explain virtual memory, "
    "paging, page tables, copy-on-write and caching with short, concrete examples. When a student asks a "
    "question, first restate it in one sentence, then answer in at most three sentences, and end with one "
    "question that checks their understanding. Never invent facts; say when you are unsure."
)

QUESTIONS = [
    "What is a page table?",
    "Why does copy-on-write save memory after fork()?",
    "What happens on a page fault?",
    "How does an LRU cache decide what to evict?",
    "What is internal fragmentation?",
    "Why are pages usually 4 KiB?",
]


def shared_system_prompt(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


PRESETS: dict[str, object] = {
    "shared system prompt (4 requests)": [shared_system_prompt(i) for i in range(4)],
    "four score (PagedAttention paper)": "Four score and seven years ago our",
    "chat: capital of France": [[{"role": "user", "content": "What is the capital of France?"}]],
    "long essay": [[{"role": "user", "content": "Write a long essay about the history of computer memory."}]],
}
