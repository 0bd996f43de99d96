"""Read a workload file: Mooncake's published traces, or kvscope's own request JSONL.

Both are JSON Lines (one object a line; blank lines are skipped; keys not named here are ignored).
The format is told by the first request line: one with ``hash_ids`` is Mooncake's, one with
``prompt`` is kvscope's, and every later line must be of the same format.

**Mooncake** (kvcache-ai/Mooncake, ``FAST25-release/traces/``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 2354]}

- ``timestamp``: arrival in **milliseconds** from the trace's start, a number >= 0, never going back;
- ``input_length``: prompt tokens (>= 1); ``output_length``: output tokens (>= 0; a request always
  samples at least its first token, so 0 runs as 1);
- ``hash_ids``: one id (an integer >= 0) per 512-token block of the prompt, at most
  ceil(input_length / 512) of them; ids are chained like vLLM's block hashes: two requests share
  a block id exactly when they share that block's whole prefix. The prompt's tokens are made from
  these ids (``tokens.py``). A line with fewer ids than blocks gives the blocks without an id
  private ids of their own (never shared).

**kvscope**, for your own traffic::

    {"arrival": 0.0, "prompt": "You are a helpful assistant. Summarise ...", "max_tokens": 128}
    {"arrival": 0.25, "prompt": [128000, 2675, 527, 264], "max_tokens": 16}

- ``arrival``: **seconds** from the start, a number >= 0, never going back;
- ``prompt``: text (needs a tokenizer: ``read_workload(path, tokenizer=...)``; the same tokenizer as
  the model you mean, so that shared text gives shared token ids) or a list of token ids (>= 0);
- ``max_tokens``: output tokens to generate (>= 1; generated to the end, whatever they are);
- ``session`` (optional): the conversation the request belongs to, a string or an integer (what a
  session-affinity router keys on; ``--router session``).

Any bad line stops the read with a ``WorkloadError`` of one line naming the file and the line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MOONCAKE = "mooncake"
KVSCOPE = "kvscope"
FORMATS = (MOONCAKE, KVSCOPE)
MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
KVSCOPE_KEYS = ("arrival", "prompt", "max_tokens")


class WorkloadError(ValueError):
    """A bad workload file or line; its message is one line that names the file (and line)."""


@dataclass(slots=True)
class TraceRequest:
    """One request of a workload, as read: its prompt is either hash ids (Mooncake) or token ids."""

    line: int  # 1-based line in the file (errors and request ids name it)
    arrival_s: float  # seconds from the workload's start
    prompt_len: int
    max_tokens: int  # output tokens to generate (>= 1)
    hash_ids: tuple[int, ...] | None = None  # Mooncake: one per hash block (the last may be partial)
    token_ids: list[int] | None = None  # kvscope: the prompt's token ids
    output_len: int = 0  # as the file says (Mooncake's output_length may be 0)
    session: str | int | None = None  # kvscope: the conversation, if the file names it


@dataclass(slots=True)
class Workload:
    path: str
    format: str  # "mooncake" or "kvscope"
    requests: list[TraceRequest]
    hash_block_size: int = MOONCAKE_BLOCK  # tokens per hash id (Mooncake)
    num_private_blocks: int = 0  # Mooncake blocks that had no id in the file (given private ones)
    tokenizer_name: str = field(default="")  # the tokenizer that made text prompts' ids, if any

    @property
    def name(self) -> str:
        return Path(self.path).stem

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def max_hash_id(self) -> int:
        return max((max(r.hash_ids) for r in self.requests if r.hash_ids), default=-1)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_workload(path: str | Path, tokenizer=None, format: str = "auto", limit: int | None = None) -> Workload:
    """Read every request of ``path`` (or its first ``limit``). Raises ``WorkloadError`` (one line).

    ``tokenizer``: anything with ``encode(text) -> list[int]`` (a transformers tokenizer), needed
    only by text prompts; ``format``: "auto" (told by the first line), "mooncake" or "kvscope".
    """
    path = Path(path)
    if format not in ("auto", *FORMATS):
        raise WorkloadError(f"unknown workload format {format!r} (auto, {', '.join(FORMATS)})")
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read it ({e.strerror or e})") from None
    requests: list[TraceRequest] = []
    last_arrival = 0.0
    with f:
        try:
            for lineno, text in enumerate(f, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if not text.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise WorkloadError(f"{where}: a request must be a JSON object, got {type(obj).__name__}")
                if format == "auto":
                    format = _detect(obj, where)
                req = _mooncake(obj, where, lineno) if format == MOONCAKE else _kvscope(obj, where, lineno, tokenizer)
                if req.arrival_s < last_arrival:
                    unit = f"timestamp {obj['timestamp']} ms" if format == MOONCAKE else f"arrival {req.arrival_s} s"
                    raise WorkloadError(
                        f"{where}: {unit} goes back in time (the line before arrives at "
                        f"{last_arrival:g} s); requests must be in arrival order"
                    )
                last_arrival = req.arrival_s
                requests.append(req)
        except UnicodeDecodeError as e:
            raise WorkloadError(f"{path}: not UTF-8 text ({e.reason})") from None
    if not requests:
        raise WorkloadError(f"{path}: no requests in the file")
    workload = Workload(
        str(path),
        format,
        requests,
        tokenizer_name=getattr(tokenizer, "name_or_path", "") if tokenizer is not None else "",
    )
    if format == MOONCAKE:
        _give_private_ids(workload)
    return workload


def _detect(obj: dict, where: str) -> str:
    if "hash_ids" in obj:
        return MOONCAKE
    if "prompt" in obj:
        return KVSCOPE
    raise WorkloadError(
        f"{where}: neither a Mooncake request ({', '.join(MOONCAKE_KEYS)}) nor a kvscope "
        f"request ({', '.join(KVSCOPE_KEYS)})"
    )


def _need(obj: dict, keys: Sequence[str], where: str, fmt: str) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise WorkloadError(
            f"{where}: missing {', '.join(repr(k) for k in missing)} (a {fmt} request has {', '.join(keys)})"
        )


def _mooncake(obj: dict, where: str, lineno: int) -> TraceRequest:
    if "hash_ids" not in obj and "prompt" in obj:
        raise WorkloadError(f"{where}: a kvscope request in a Mooncake workload (the first line set the format)")
    _need(obj, MOONCAKE_KEYS, where, "Mooncake")
    ts, n, out, ids = (obj[k] for k in MOONCAKE_KEYS)
    if not _number(ts) or ts < 0:
        raise WorkloadError(f"{where}: 'timestamp' must be a number of milliseconds >= 0, got {ts!r}")
    if not _int(n) or n < 1:
        raise WorkloadError(f"{where}: 'input_length' must be an integer >= 1, got {n!r}")
    if not _int(out) or out < 0:
        raise WorkloadError(f"{where}: 'output_length' must be an integer >= 0, got {out!r}")
    if not isinstance(ids, list):
        raise WorkloadError(f"{where}: 'hash_ids' must be a list of integers, got {type(ids).__name__}")
    for h in ids:
        if not _int(h) or h < 0:
            raise WorkloadError(f"{where}: 'hash_ids' must hold integers >= 0, got {h!r}")
    most = -(-n // MOONCAKE_BLOCK)
    if len(ids) > most:
        raise WorkloadError(
            f"{where}: {len(ids)} hash ids for input_length {n}, but {n} tokens make at most "
            f"ceil({n} / {MOONCAKE_BLOCK}) = {most} blocks"
        )
    return TraceRequest(lineno, ts / 1000.0, n, max(1, out), tuple(ids), output_len=out)


def _kvscope(obj: dict, where: str, lineno: int, tokenizer) -> TraceRequest:
    if "hash_ids" in obj:
        raise WorkloadError(f"{where}: a Mooncake request in a kvscope workload (the first line set the format)")
    _need(obj, KVSCOPE_KEYS, where, "kvscope")
    arrival, prompt, max_tokens = (obj[k] for k in KVSCOPE_KEYS)
    if not _number(arrival) or arrival < 0:
        raise WorkloadError(f"{where}: 'arrival' must be a number of seconds >= 0, got {arrival!r}")
    if not _int(max_tokens) or max_tokens < 1:
        raise WorkloadError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise WorkloadError(f"{where}: 'prompt' is empty")
        if tokenizer is None:
            raise WorkloadError(
                f"{where}: a text prompt needs a tokenizer (give one, e.g. --tokenizer, or write "
                "the prompt as a list of token ids)"
            )
        try:
            ids = list(tokenizer.encode(prompt))
        except Exception as e:  # noqa: BLE001 - a tokenizer's failure, said on the line that caused it
            raise WorkloadError(f"{where}: the tokenizer failed on this prompt ({type(e).__name__}: {e})") from None
        if not ids:
            raise WorkloadError(f"{where}: 'prompt' is empty after tokenization")
    elif isinstance(prompt, list):
        if not prompt:
            raise WorkloadError(f"{where}: 'prompt' is an empty list")
        for t in prompt:
            if not _int(t) or t < 0:
                raise WorkloadError(f"{where}: a token-id prompt must hold integers >= 0, got {t!r}")
        ids = prompt
    else:
        raise WorkloadError(f"{where}: 'prompt' must be text or a list of token ids, got {type(prompt).__name__}")
    session = obj.get("session")
    if session is not None and not (isinstance(session, str) and session or _int(session)):
        raise WorkloadError(f"{where}: 'session' must be a non-empty string or an integer, got {session!r}")
    return TraceRequest(
        lineno, float(arrival), len(ids), max_tokens, token_ids=ids, output_len=max_tokens, session=session
    )


def _give_private_ids(w: Workload) -> None:
    """Blocks a Mooncake line left without an id get ids above every id in the file: never shared."""
    next_id = w.max_hash_id + 1
    bs = w.hash_block_size
    for r in w.requests:
        want = -(-r.prompt_len // bs)
        have = r.hash_ids or ()  # a Mooncake line's: set
        if len(have) < want:
            extra = want - len(have)
            r.hash_ids = have + tuple(range(next_id, next_id + extra))
            next_id += extra
            w.num_private_blocks += extra
