"""The embedded GGUF is converted once and read from the cache afterwards, with identical weights."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.runner.models import loader


def test_second_load_reads_the_cached_conversion_with_identical_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    src = loader.embedded_source()
    calls = []
    real = loader._load
    monkeypatch.setattr(loader, "_load", lambda s, d, dev: (calls.append(s.gguf_file), real(s, d, dev))[1])
    fresh, tok1 = loader.load_hf_model(src, "auto", torch.device("cpu"))
    folder = loader.gguf_cache_dir(src)
    assert (folder / loader.COMPLETE).is_file() and calls[0] == src.gguf_file
    calls.clear()
    again, tok2 = loader.load_hf_model(src, "auto", torch.device("cpu"))
    assert calls == [None]  # from the safetensors copy: no GGUF dequantization
    a, b = fresh.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    text = "Four score and seven years ago our fathers <|im_start|>user\nhi"
    assert tok1.encode(text) == tok2.encode(text) and tok1.chat_template == tok2.chat_template
    assert tok2.name_or_path == tok1.name_or_path  # block hashes stay the same across the cache
    half, _ = loader.load_hf_model(src, "float16", torch.device("cpu"))
    assert half.dtype == torch.float16 and calls[-1] is None


def test_a_torn_cache_entry_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    src = loader.embedded_source()
    folder = loader.gguf_cache_dir(src)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{")  # a crash mid-write: no completion marker
    model, tok = loader.load_hf_model(src, "auto", torch.device("cpu"))
    assert (folder / loader.COMPLETE).is_file() and tok is not None


def test_a_conversion_that_cannot_be_cached_is_done_once_and_used(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "_save_converted", lambda *a: None)  # as if the cache folder refused writes
    calls = []
    real = loader._load
    monkeypatch.setattr(loader, "_load", lambda s, d, dev: (calls.append(s.gguf_file), real(s, d, dev))[1])
    parsed = []  # GGUF files parsed (gguf_once.py: transformers would parse it three times a load)
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a, **k: (parsed.append(path), reader(path, *a, **k))[1])
    counting = gguf.GGUFReader
    model, tok = loader.load_model(loader.embedded_source(), "auto", torch.device("cpu"))
    assert calls == [loader.embedded_source().gguf_file]  # one dequantization, not one per fallback
    assert len(parsed) == 1 and gguf.GGUFReader is counting and gguf.get_tensor_name_map is name_map  # put back
    assert model.num_layers == 30 and tok is not None
    assert not (loader.gguf_cache_dir(loader.embedded_source()) / loader.COMPLETE).exists()


def test_a_load_that_fails_puts_ggufs_names_back():
    from engine.runner.models.gguf_once import gguf_parsed_once

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(OSError, match="^a truncated GGUF file$"), gguf_parsed_once():  # the load's own error
        assert gguf.GGUFReader is not reader  # swapped for the load
        raise OSError("a truncated GGUF file")
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    with gguf_parsed_once():  # and the next load takes the lock again: the failure did not hold it
        pass


def test_a_conversion_made_elsewhere_is_known_by_its_weights_not_its_converter():
    """A folder named on another machine (another transformers, another cache format: a probe recording names the
    folder vLLM served from) is a conversion of the embedded GGUF when its name says the same file and content."""
    src = loader.embedded_source()
    here = loader.gguf_cache_dir(src)
    assert loader.is_conversion_of(str(here), src)
    weights = here.name.split("-transformers")[0]
    assert loader.is_conversion_of(f"/home/someone/.cache/kvscope/gguf/{weights}-transformers4.57.0", src)
    assert loader.is_conversion_of(f"{weights}-transformers5.25.0-f1", src)
    stem, digest = weights.rsplit("-", 1)
    assert not loader.is_conversion_of(f"/x/{stem}-{'0' * len(digest)}-transformers5.25.0-f2", src)  # other bytes
    assert not loader.is_conversion_of(f"/x/{weights}", src)  # not a conversion's folder name
