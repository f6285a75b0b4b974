"""Checkpoints: what one holds, the last k kept, a failed or killed write leaving the previous one, a
damaged one named."""

import json

import pytest
import torch

from qatune.train import TrainingInterrupted, train
from qatune.train.checkpoint import find_checkpoint, list_checkpoints
from tests.conftest import interrupt_at, resume_config


def test_checkpoints_keep_the_last_k(tmp_path):
    run = train(resume_config(tmp_path, "train.keep_checkpoints=2"), output_dir=tmp_path / "run", progress=False)
    assert [p.name for p in list_checkpoints(run)] == ["step-0000008", "step-0000009"]
    checkpoint = list_checkpoints(run)[-1]
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json",
                 "tokenizer.json", "qatune.json", "config.yaml"):
        assert (checkpoint / name).is_file(), name
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["consumed"]) == (9, 3, 0)
    # The optimizer state is written without zip CRC-32s (torch.load never checks them), reads back
    # whole, and torch.save's global setting is left as it was.
    import zipfile

    with zipfile.ZipFile(checkpoint / "optimizer.pt") as archive:
        assert {info.CRC for info in archive.infolist() if "/data/" in info.filename} == {0}
    optimizer_state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    moments = [s["exp_avg_sq"] for s in optimizer_state["state"].values()]
    assert moments and all(torch.isfinite(m).all() for m in moments)
    assert torch.serialization.get_crc32_options()


def test_a_failed_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    from qatune.train import checkpoint as checkpoint_module

    calls = {"n": 0}
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # the 2nd checkpoint, while its optimizer state is written
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", failing_save)
    with pytest.raises(OSError):
        train(resume_config(tmp_path), output_dir=tmp_path / "run", progress=False)
    names = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()]
    assert names == ["step-0000002"]                      # no half-written step-0000004, no temporary folder
    assert find_checkpoint(tmp_path / "run").name == "step-0000002"
    assert torch.serialization.get_crc32_options()         # restored after the failure too


def test_resume_ignores_a_temporary_folder_left_by_a_kill(tmp_path, monkeypatch):
    interrupt_at(monkeypatch, 2)
    with pytest.raises(TrainingInterrupted):
        train(resume_config(tmp_path), output_dir=tmp_path / "run", progress=False)
    junk = tmp_path / "run" / "checkpoints" / ".tmp-step-0000003"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"partial")
    assert find_checkpoint(tmp_path / "run").name == "step-0000002"


def test_a_saved_logging_window_without_all_its_numbers_marks_the_checkpoint_damaged(tmp_path, monkeypatch):
    from qatune.runs import atomic
    from qatune.train.checkpoint import damage

    interrupt_at(monkeypatch, 6)
    with pytest.raises(TrainingInterrupted) as err:
        train(resume_config(tmp_path, "train.logging_steps=4"), output_dir=tmp_path / "run", progress=False)
    checkpoint = err.value.checkpoint
    assert damage(checkpoint) is None
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["log_window"]["seconds"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    atomic.write_manifest(checkpoint)
    assert "log_window must be an object of the numbers ['loss_sum', 'items', 'tokens', 'seconds']" in damage(
        checkpoint)
