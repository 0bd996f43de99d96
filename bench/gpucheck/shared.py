"""What the acceptance run's sections share: the card, the model shapes, random weights, a section's report."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # the other benchmarks' ``common`` (serve_load imports it so)

# Peak HBM bandwidth (GB/s) and dense fp16/bf16 tensor-core rate (TFLOP/s) by the vendors' datasheets.
PEAKS = {
    "H200": (4800, 989.5),
    "H100 SXM": (3350, 989.5),
    "H100 PCIe": (2000, 756),
    "H100": (3350, 989.5),
    "A100-SXM4-80GB": (2039, 312),
    "A100 80GB PCIe": (1935, 312),
    "A100": (1555, 312),
    "L40S": (864, 362),
    "L4": (300, 121),
    "RTX 4090": (1008, 165),
    "RTX 3090": (936, 71),
    "A10": (600, 125),
    "T4": (320, 65),
}

SHAPES = {
    # Llama-2-7B's layers; the vocabulary is the tokenizer's where a section needs text (``with_vocab``).
    "llama-2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    # A 0.4B model of Llama's layout (fp32 sections that compare greedy outputs exactly).
    "llama-small": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
}


@dataclass
class Ctx:
    """One section's run: the rehearsal (``dry_run``: tiny shapes on the CPU) or the card."""

    dry_run: bool
    out: Path
    budget_s: float
    t0: float = field(default_factory=time.monotonic)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry_run else "cuda")

    @property
    def big(self) -> str:
        """The serving-size shape."""
        return "tiny" if self.dry_run else "llama-2-7b"

    @property
    def small(self) -> str:
        return "tiny" if self.dry_run else "llama-small"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.dry_run else torch.float16

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def n(self, gpu: int, dry: int) -> int:
        return dry if self.dry_run else gpu


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def card() -> dict:
    """The card and the image: name, memory, datasheet peaks, driver and library versions."""
    import transformers
    import triton

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    if not torch.cuda.is_available():
        return {**info, "name": "cpu (dry run)", "memory_gib": None, "peak_gbs": None, "peak_tflops": None}
    name = torch.cuda.get_device_name()
    gbs, tflops = next((v for k, v in PEAKS.items() if k.lower() in name.lower()), (None, None))
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {
        **info,
        "name": name,
        "memory_gib": props.total_memory / 2**30,
        "sms": props.multi_processor_count,
        "peak_gbs": gbs,
        "peak_tflops": tflops,
        "driver": driver,
    }


def hf_config(shape: str, **overrides):
    from transformers import LlamaConfig

    return LlamaConfig(
        **{**SHAPES[shape], **overrides},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )


def random_state(config, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Yields (transformers name, random tensor) for every weight of a Llama of ``config``: N(0, 0.02) as
    transformers initialises them, norms at 1, made on the device one at a time (no model built twice)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in skeleton.named_parameters():
        if name.endswith("norm.weight"):
            yield name, torch.ones(p.shape, dtype=dtype, device=device)
        else:
            yield name, (torch.randn(p.shape, generator=g, dtype=torch.float32, device=device) * 0.02).to(dtype)


@functools.lru_cache(maxsize=2)
def random_native(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0, **overrides):
    """The engine's own ``LlamaForCausalLM`` over random weights of ``shape`` (no transformers model), built once
    a process: the sections of one group share it (engines over it each have their own pool)."""
    from engine.runner.models.llama import LlamaForCausalLM
    from engine.runner.models.rotary import build_rotary

    config = hf_config(shape, **overrides)
    weights = dict(random_state(config, dtype, device, seed))
    model = LlamaForCausalLM(config, lambda name: weights.pop(name, None), build_rotary(config))
    return model.eval().to(device)


def random_hf(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0, **overrides):
    """A transformers model over the same random weights as ``random_native`` (for ``generate``)."""
    from transformers import LlamaForCausalLM

    config = hf_config(shape, **overrides)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(dict(random_state(config, dtype, device, seed)), assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)  # its buffers were on meta
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def tokenizer_folder() -> Path | None:
    """SmolLM2's tokenizer saved as a folder: carried in ``.whl/tokenizer`` to the card (no GGUF reader there),
    else exported here from the embedded GGUF once."""
    for p in (os.environ.get("KVSCOPE_GPU_TOKENIZER"), ROOT / ".whl" / "tokenizer"):
        if p and (Path(p) / "tokenizer_config.json").exists():
            return Path(p)
    out = Path("/tmp/kvscope-gpucheck-tokenizer")
    if (out / "tokenizer_config.json").exists():
        return out
    try:
        from engine.runner.models.loader import embedded_source, load_tokenizer

        src = embedded_source()
        tok = load_tokenizer(str(Path(src.path) / src.gguf_file))
    except Exception as e:  # noqa: BLE001 - reported by the caller
        print(f"gpucheck: no tokenizer ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    tok.save_pretrained(out)
    return out


def scratch_folder(name: str) -> Path:
    """Where a checkpoint folder is written: /dev/shm (memory: 13.5 GB written and read back in seconds) when it
    has room for a 7B model, else /tmp."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 20 * 2**30:
        return shm / name
    return Path("/tmp") / name


def make_folder(shape: str, dtype: torch.dtype, device: torch.device, folder: Path) -> Path:
    """A checkpoint folder of random weights (safetensors shards), its config and SmolLM2's tokenizer, whose
    vocabulary the model takes, so that text prompts and outputs are real tokens. Written once."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    done = folder / "kvscope-gpucheck-complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok_dir = tokenizer_folder()
    if tok_dir is None:
        raise RuntimeError("no tokenizer for the checkpoint folder (.whl/tokenizer, or the embedded GGUF)")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    config = hf_config(shape, vocab_size=len(tok))
    config.torch_dtype = dtype
    shard, size, index = {}, 0, 0
    for name, t in random_state(config, dtype, device):
        shard[name] = t.cpu()
        size += t.numel() * t.element_size()
        if size >= 2 << 30:
            save_file(shard, str(folder / f"model-{index:05d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, str(folder / f"model-{index:05d}.safetensors"))
    config.save_pretrained(folder)
    tok.save_pretrained(folder)
    done.write_text("ok\n")
    return folder


@dataclass
class Check:
    what: str
    value: str
    aim: str
    ok: bool
    hard: bool = True  # a hard check failing fails the section; an aim missed is reported as such


@dataclass
class Table:
    title: str
    columns: list[tuple[str, str, str]]  # (key, header, format)
    rows: list[dict]


@dataclass
class Section:
    name: str
    title: str
    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # raw figures for the JSON (and the README's plots)
    seconds: float = 0.0
    error: str | None = None

    def check(self, what: str, value, aim: str, ok: bool, hard: bool = True) -> bool:
        self.checks.append(Check(what, str(value), aim, bool(ok), hard))
        return bool(ok)

    @property
    def verdict(self) -> str:
        if self.error:
            return "FAIL: " + self.error
        if any(not c.ok and c.hard for c in self.checks):
            return "FAIL"
        if any(not c.ok for c in self.checks):
            return "aim missed"
        return "pass"

    @classmethod
    def from_json(cls, d: dict) -> Section:
        d = {k: v for k, v in d.items() if k != "verdict"}
        d["checks"] = [Check(**c) for c in d.get("checks", [])]
        d["tables"] = [Table(t["title"], [tuple(c) for c in t["columns"]], t["rows"]) for t in d.get("tables", [])]
        return cls(**d)

    def to_json(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1, default=str))
