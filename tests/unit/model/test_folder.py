"""A trained model's folder: written atomically, self-contained, with the umask's modes; adapters read from
safetensors only."""

import os
import stat

import pytest
import torch

from qatune.config import ScratchModel, load_config
from qatune.model.folder import NO_WEIGHT_CONVERSIONS, ModelInfo, save_model
from qatune.model.scratch_tokenizer import train_scratch_tokenizer
from qatune.model.sources import (
    build_scratch,
)
from qatune.runs.layout import find_model_folder
from tests.conftest import ITEM_TEXTS


def test_save_model_is_atomic_and_self_contained(scratch_gpt2, tmp_path):
    model, tokenizer = scratch_gpt2
    config = load_config(None, ["model.scratch.n_layer=1", "data.train_file=x.csv"])
    info = ModelInfo(task="generative", max_length=32)
    save_model(tmp_path / "final", model, tokenizer, config, info)
    save_model(tmp_path / "final", model, tokenizer, config, info)  # replacing works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temporary folders left
    assert find_model_folder(tmp_path) == tmp_path / "final"
    assert find_model_folder(tmp_path / "final") == tmp_path / "final"
    assert ModelInfo.load(tmp_path / "final") == info


@pytest.mark.parametrize("task, architecture", [("generative", "auto"), ("generative", "t5"), ("extractive", "auto")])
def test_scratch_models_save_without_the_weight_conversion_lookup(task, architecture, tmp_path):
    """save_pretrained skips its table of weight conversions for the scratch classes: exact only while the
    installed transformers converts none of their weights, which this checks, and the files match."""
    from safetensors.torch import load_file
    from transformers.core_model_loading import revert_weight_conversion

    tokenizer = train_scratch_tokenizer(task, ITEM_TEXTS, 400, architecture)
    shape = ScratchModel(n_layer=1, n_embd=32, n_head=2, n_positions=64, architecture=architecture)
    model = build_scratch(shape, task, tokenizer)
    assert type(model).__name__ in NO_WEIGHT_CONVERSIONS
    state = model.state_dict()
    assert revert_weight_conversion(model, state) is state  # transformers found no conversion to revert
    model.save_pretrained(tmp_path / "original")
    config = load_config(None, ["model.scratch.n_layer=1", "data.train_file=x.csv"])
    save_model(tmp_path / "qatune", model, tokenizer, config, ModelInfo(task=task, max_length=32))
    original = load_file(tmp_path / "original" / "model.safetensors")
    ours = load_file(tmp_path / "qatune" / "model.safetensors")
    assert sorted(ours) == sorted(original)
    assert all(torch.equal(ours[k], original[k]) for k in original)


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_saved_model_folder_follows_the_umask(scratch_gpt2, tmp_path, umask, folder_mode, file_mode):
    model, tokenizer = scratch_gpt2
    config = load_config(None, ["model.scratch.n_layer=1", "data.train_file=x.csv"])
    old = os.umask(umask)
    try:
        save_model(tmp_path / "final", model, tokenizer, config, ModelInfo(task="generative", max_length=32))
    finally:
        os.umask(old)
    paths = [tmp_path / "final", *(tmp_path / "final").rglob("*")]
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in paths}
    assert "final/model.safetensors" in modes
    assert modes == {name: folder_mode if (tmp_path / name).is_dir() else file_mode for name in modes}


def test_lora_adapters_are_loaded_from_safetensors_only(tmp_path):
    pytest.importorskip("peft")
    from qatune.errors import RunDirError
    from qatune.model.folder import ModelInfo, _load_lora

    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(RunDirError, match=r"no adapter_model\.safetensors"):
        _load_lora(tmp_path, ModelInfo(task="generative", max_length=8, lora_base="base"), None, False)
