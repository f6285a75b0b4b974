"""Crash-safe writes: a folder is removed by renaming it away first."""

import os
import shutil

import pytest

from qatune.train.checkpoint import list_checkpoints


def test_a_checkpoint_is_pruned_by_renaming_it_away_before_deleting_it(tmp_path, monkeypatch):
    # A kill in the middle of deleting an old checkpoint must not leave a half-deleted step-N behind.

    from qatune.runs import atomic

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-0000003"
    step.mkdir(parents=True)
    for name in ("trainer_state.json", "model.safetensors", "optimizer.pt"):
        (step / name).write_text("{}")
    real_rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):
        if os.path.basename(path).startswith(".step-0000003-old-") and os.path.exists(path):
            os.remove(os.path.join(path, "model.safetensors"))
            raise KeyboardInterrupt  # stands for the SIGKILL, after part of the folder is gone
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic.remove_dir(step)
    assert not step.exists() and list_checkpoints(run) == []
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    atomic.remove_stale_temporaries(run / "checkpoints")
    assert list((run / "checkpoints").iterdir()) == []
