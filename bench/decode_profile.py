"""One decode step of the served engine, split: matmuls, attention, the KV store, sampling, the scheduler and
block bookkeeping, the outputs, the inspector and the server's streaming.

    python bench/decode_profile.py [--block-size 32] [--inspect window] [--label after] [--no-fuse-ops]

kvscope's server (``peer_kvscope_server.py``, the inspector's bookkeeping as the window runs it unless
``--inspect`` says otherwise) on the embedded SmolLM2-135M in float32, one CPU thread, streaming 1, 8 and then 32
requests at once (128 tokens each, ``ignore_eos``) from a client process; the steps in which exactly 8 (32)
requests each decoded one token are averaged (``step_sections.py``: the engine thread's CPU time per section,
each exclusive of the sections it calls, and the HTTP thread's CPU time while the step ran). Writes
``bench/results/decode_profile_LABEL.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from openai_load import run_load
from peer_common import kvscope_server, make_prompts, model_folder
from step_sections import summarise

from common import write_results

BATCHES = (1, 8, 32)


def profile(block_size: int, inspect: str, max_tokens: int = 128, fuse_ops: bool = True) -> list[dict]:
    model = model_folder()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="kvscope-sections-")
    os.close(fd)
    server = kvscope_server(model, block_size, inspect, profile=path, extra=() if fuse_ops else ("--no-fuse-ops",))
    try:
        run_load(server.url, None, make_prompts(2), 2, 8)  # warm-up
        for n in BATCHES:
            run_load(server.url, None, make_prompts(n, seed=n), n, max_tokens)
    finally:
        server.close()
    rows = json.loads(Path(path).read_text())
    os.unlink(path)
    return [s for n in BATCHES if (s := summarise(rows, n)) is not None]


def print_split(splits: list[dict]) -> None:
    keys = list(dict.fromkeys(k for s in splits for k in s["sections_ms"]))
    print("| section | " + " | ".join(f"{s['running']} running, ms" for s in splits) + " |")
    print("|---|" + "---:|" * len(splits))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{s['sections_ms'].get(k, 0.0):.2f}" for s in splits) + " |")
    print("| **engine thread, total** | " + " | ".join(f"{s['engine_thread_ms']:.1f}" for s in splits) + " |")
    print("| steps averaged | " + " | ".join(str(s["steps"]) for s in splits) + " |")
    print("| step's wall time, ms | " + " | ".join(f"{s['wall_ms']:.1f}" for s in splits) + " |")
    print(
        "| of it on a CPU / waiting for one, ms | "
        + " | ".join(f"{s['on_cpu_ms']:.1f} / {s['runqueue_ms']:.1f}" for s in splits)
        + " |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--inspect", default="window", choices=("window", "headless", "off"))
    ap.add_argument("--label", default="now", help="the results file's suffix (before, after, ...)")
    ap.add_argument("--no-fuse-ops", action="store_true", help="PyTorch's ops one by one (the fused kernels' baseline)")
    args = ap.parse_args()
    splits = profile(args.block_size, args.inspect, fuse_ops=not args.no_fuse_ops)
    print_split(splits)
    config = {
        "block_size": args.block_size,
        "inspect": args.inspect,
        "threads": 1,
        "dtype": "float32",
        "fuse_ops": not args.no_fuse_ops,
    }
    write_results(f"decode_profile_{args.label}", {"config": config, "rows": splits}, quick=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
