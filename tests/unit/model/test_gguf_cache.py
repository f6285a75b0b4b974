"""A .gguf file converted once into qatune's cache and read from there: the same tokenizer, config and weights as
reading the file, one conversion for many loads, a new one for a changed file, nothing kept when caching is off,
when the disk is too full or when converting fails, and a damaged folder converted again."""

import logging
import os

import pytest
import torch

from qatune.config import Config, DataConfig, ModelConfig
from qatune.model import gguf_cache, sources
from qatune.model.folder import LoadedModel, ModelInfo
from qatune.model.sources import load_model_config, load_pretrained, load_tokenizer
from tests.conftest import chat_tokenizer, tiny_llama

pytest.importorskip("gguf")

TEXT = "<|im_start|>user\nWhat's Łódź's river?  Ünïcode 日本\n\n x<|im_end|>"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny Llama with SmolLM2's chat template written as an f32 GGUF file."""
    from qatune.export.gguf_write import write_gguf

    tmp = tmp_path_factory.mktemp("gguf")
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer)
    config = Config(task="generative", model=ModelConfig(name_or_path="tiny"), data=DataConfig(train_file="qa.csv"))
    info = ModelInfo(task="generative", max_length=64)
    write_gguf(LoadedModel(model, tokenizer, config, info, tmp / "final"), tmp / "tiny.gguf", "f32")
    return tmp / "tiny.gguf"


def loaded(file, convert=True):
    """What qatune loads of ``file``: (tokenizer ids of TEXT, chat template, config, state dict, model)."""
    model = ModelConfig(name_or_path=str(file))
    tokenizer = load_tokenizer(model, "generative", convert)
    config = load_model_config(model, convert)
    weights = load_pretrained(model, "generative", tokenizer, config, convert=convert)
    plain = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    return tokenizer(TEXT).input_ids, tokenizer.chat_template, plain, weights.state_dict(), weights


@pytest.fixture
def conversions(monkeypatch, tmp_path):
    """A fresh cache in tmp_path/cache; the list of files converted into it."""
    monkeypatch.setenv("QATUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "_failed", set())
    converted = []
    convert = sources._convert

    def counted(model, source, folder):
        converted.append(source.gguf_file)
        convert(model, source, folder)

    monkeypatch.setattr(sources, "_convert", counted)
    return converted


def direct(file, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("QATUNE_CACHE_DIR", "off")
        return loaded(file)


def assert_same(a, b):
    assert a[:3] == b[:3]
    assert list(a[3]) == list(b[3]) and all(torch.equal(a[3][k], b[3][k]) for k in a[3])


def test_a_gguf_file_is_converted_once_and_read_back_as_the_file_reads(gguf_file, conversions, monkeypatch, tmp_path,
                                                                       caplog):
    expected = direct(gguf_file, monkeypatch)
    assert conversions == [] and not (tmp_path / "cache").exists()
    with caplog.at_level(logging.INFO, logger="qatune"):
        first = loaded(gguf_file)
    entry = gguf_cache.entry_for(gguf_file)
    assert conversions == ["tiny.gguf"] and entry.parent == tmp_path / "cache" / "gguf"
    assert f"tiny.gguf converted into {entry}: later commands read it from there (QATUNE_CACHE_DIR=off keeps " \
           "nothing)" in caplog.text
    assert {"model.safetensors", "config.json", "tokenizer.json", "gguf-metadata.json"} <= {
        p.name for p in entry.iterdir()}
    assert_same(first, expected)
    assert first[4].lm_head.weight is first[4].model.embed_tokens.weight  # still tied
    assert first[4].config.name_or_path == str(gguf_file.parent)  # the file's folder, not the cache's
    second = loaded(gguf_file)
    assert conversions == ["tiny.gguf"]  # read from the folder
    assert_same(second, expected)
    assert gguf_cache.metadata(gguf_file) == gguf_cache.read_metadata(gguf_file)
    assert gguf_cache.metadata(gguf_file)["qatune.model_info"].startswith('{"task": "generative"')
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_a_changed_file_is_converted_again_and_only_the_last_used_folders_stay(gguf_file, conversions, monkeypatch,
                                                                                tmp_path):
    monkeypatch.setattr(gguf_cache, "KEEP", 1)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    loaded(copy)
    before = gguf_cache.entry_for(copy)
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))  # written again, say
    after = gguf_cache.entry_for(copy)
    assert after != before and gguf_cache.converted(copy) is None
    loaded(copy)
    assert conversions == ["copy.gguf", "copy.gguf"]
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [after.name]


def test_nothing_is_kept_when_off_when_told_not_to_or_when_the_disk_is_too_full(gguf_file, conversions, monkeypatch,
                                                                               tmp_path, caplog):
    expected = direct(gguf_file, monkeypatch)
    assert_same(loaded(gguf_file, convert=False), expected)  # an exported file's check reads it once
    assert conversions == [] and not (tmp_path / "cache" / "gguf").exists()
    free = type("Usage", (), {"free": 2**30 + 100})
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda path: free)
    with caplog.at_level(logging.INFO, logger="qatune"):
        assert_same(loaded(gguf_file), expected)
    assert conversions == ["tiny.gguf"] and gguf_cache.converted(gguf_file) is None
    assert caplog.text.count("tiny.gguf is read directly") == 1  # tried once for tokenizer, config and weights
    assert ("tiny.gguf is read directly: its converted weights need 0.0 GiB and the disk of "
            f"{tmp_path / 'cache' / 'gguf'} has 1.0 GiB free") in caplog.text
    assert not list((tmp_path / "cache" / "gguf").iterdir())
    monkeypatch.setattr(gguf_cache, "_failed", set())  # another command, a disk with room and a larger file
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 2**40}))
    monkeypatch.setattr(gguf_cache, "LARGEST", 1000)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qatune"):
        assert_same(loaded(gguf_file), expected)
    assert "tiny.gguf is read directly: its converted weights would take 0.0 GiB, more than the 0 GiB qatune keeps " \
           "of one file" in caplog.text
    assert gguf_cache.converted(gguf_file) is None


def test_a_failed_conversion_reads_the_file_and_a_damaged_folder_is_converted_again(gguf_file, conversions,
                                                                                   monkeypatch, tmp_path, caplog):
    expected = direct(gguf_file, monkeypatch)
    convert = sources._convert

    def failing(model, source, folder):
        (folder / "partial.bin").write_bytes(b"0" * 100)
        raise RuntimeError("no such architecture")

    monkeypatch.setattr(sources, "_convert", failing)
    with caplog.at_level(logging.INFO, logger="qatune"):
        assert_same(loaded(gguf_file), expected)
    assert "tiny.gguf is read directly: it could not be kept in" in caplog.text and "(no such architecture)" in \
        caplog.text
    assert not list((tmp_path / "cache" / "gguf").iterdir())
    monkeypatch.setattr(sources, "_convert", convert)
    monkeypatch.setattr(gguf_cache, "_failed", set())  # another command
    loaded(gguf_file)
    weights = gguf_cache.entry_for(gguf_file) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # truncated
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qatune"):
        assert_same(loaded(gguf_file), expected)
    assert f"{weights} has" in caplog.text and "(truncated or replaced); it is converted again" in caplog.text
    assert conversions == ["tiny.gguf", "tiny.gguf"]


def test_the_quick_reader_reads_what_ggufs_reader_reads_and_transformers_reads_with_it(gguf_file, monkeypatch):
    import gguf
    from gguf.gguf_reader import GGUFReader

    slow, quick = GGUFReader(str(gguf_file)), gguf_cache.quick_reader()(str(gguf_file))
    assert list(slow.fields) == list(quick.fields) and "tokenizer.ggml.tokens" in quick.fields
    for name, field in slow.fields.items():
        assert field.types == quick.fields[name].types
        assert [part.tobytes() for part in field.parts] == [part.tobytes() for part in quick.fields[name].parts]
    assert quick.fields["tokenizer.ggml.tokens"].contents() == slow.fields["tokenizer.ggml.tokens"].contents()
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data.tobytes()) for t in slow.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data.tobytes()) for t in quick.tensors]
    monkeypatch.setattr(gguf, "GGUFReader", GGUFReader)  # as before any file was read here; restored after
    direct(gguf_file, monkeypatch)  # read through transformers
    assert gguf.GGUFReader is gguf_cache.quick_reader()
