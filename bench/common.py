"""What the benchmarks share: models, length mixes, a fake model runner, waste, results and plots."""

from __future__ import annotations

import functools
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import LLMEngine  # noqa: E402
from engine.core.scheduler import SchedulerOutput  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {dev}, torch {torch.__version__}"


@functools.cache
def smollm2():
    """(hf_model, tokenizer, name) of the embedded SmolLM2, loaded once per process."""
    from engine.runner.models.loader import embedded_source, load_hf_model

    src = embedded_source()
    model, tok = load_hf_model(src, "auto", torch.device("cpu"))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tok.eos_token_id
    return model, tok, src.name


@functools.cache
def tiny_model():
    """A tiny random Llama: fast enough that the engine's own overhead shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, None, "tiny-llama"


def model_for(quick: bool):
    return tiny_model() if quick else smollm2()


def engine_for(model_tok_name, **kw) -> LLMEngine:
    model, tok, name = model_tok_name
    return LLMEngine.from_hf_model(model, tok, name=name, **kw)


def length_mix(n: int, seed: int, prompt: tuple[int, int], output: tuple[int, int]) -> list[tuple[int, int]]:
    """``n`` (prompt, output) lengths, uniform in the ranges, from a fixed seed."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt), rng.randint(*output)) for _ in range(n)]


def random_prompts(
    lengths: list[int], vocab: int, seed: int, shared_prefix: list[int] | None = None
) -> list[list[int]]:
    rng = random.Random(seed)
    shared_prefix = shared_prefix or []
    return [shared_prefix + [rng.randrange(1, vocab) for _ in range(max(1, n - len(shared_prefix)))] for n in lengths]


def install_fake_runner(engine: LLMEngine) -> None:
    """Replace the model with a token generator: the scheduler and block manager run for real."""

    def apply_device_work(sched: SchedulerOutput) -> None:
        return None

    def execute(sched: SchedulerOutput):
        vocab = engine.vocab_size
        return {
            s.request.request_id: (s.request.num_tokens * 7919 + 1) % vocab for s in sched.scheduled if s.samples
        }, {}

    engine.runner.apply_device_work = apply_device_work
    engine.runner.execute = execute


def kv_waste(engine: LLMEngine) -> tuple[int, int]:
    """(allocated slots, filled slots) of the blocks in use; a shared block counts once."""
    bs = engine.config.block_size
    filled: dict[int, int] = {}
    for rid, blocks in engine.kv.req_to_blocks.items():
        req = engine.requests.get(rid)
        if req is None:
            continue
        n = req.num_computed_tokens
        for i, b in enumerate(blocks):
            filled[b.block_id] = max(filled.get(b.block_id, 0), min(bs, max(0, n - i * bs)))
    return len(filled) * bs, sum(filled.values())


def write_results(name: str, data: dict, quick: bool) -> Path:
    folder = RESULTS / "quick" if quick else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "quick": quick, "machine": machine(), "date": time.strftime("%Y-%m-%d"), **data}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def plot_path(name: str, quick: bool) -> Path:
    folder = RESULTS / "quick" if quick else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.png"


def save_figure(fig, name: str, quick: bool) -> None:
    fig.tight_layout()
    fig.savefig(plot_path(name, quick), dpi=100)
    pyplot().close(fig)


def main(run, description: str | None = None) -> None:
    """The command line every benchmark shares: ``--quick`` is the CI smoke test's size."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="a small run (CI checks its JSON's shape, not speed)")
    run(ap.parse_args().quick)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Markdown: ``cols`` = (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(format(r[k], f) if isinstance(r[k], (int, float)) else str(r[k]) for k, _, f in cols)
            + " |"
        )
    return "\n".join(lines)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]
