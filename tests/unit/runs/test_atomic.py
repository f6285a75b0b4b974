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


def test_a_folder_written_beside_one_put_in_place_meanwhile_is_dropped_or_replaces_it(tmp_path):
    """keep_existing: two processes converting the same file, the second finds the first's folder and keeps it."""
    from qatune.runs.atomic import damage, write_folder

    target = tmp_path / "entry"
    write_folder(target, lambda folder: (folder / "a.txt").write_text("first"))
    write_folder(target, lambda folder: (folder / "a.txt").write_text("second"), keep_existing=True)
    assert (target / "a.txt").read_text() == "first" and damage(target) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # the second one's temporary is gone
    write_folder(target, lambda folder: (folder / "a.txt").write_text("third"))
    assert (target / "a.txt").read_text() == "third"


def test_only_temporaries_left_long_enough_are_stale_where_others_may_be_writing(tmp_path):
    from qatune.runs.atomic import remove_stale_temporaries

    old, fresh = tmp_path / ".a-tmp-1", tmp_path / ".b-tmp-2"
    old.mkdir()
    fresh.mkdir()
    os.utime(old, (old.stat().st_atime - 7200, old.stat().st_mtime - 7200))
    remove_stale_temporaries(tmp_path, older_than_s=3600)
    assert [p.name for p in tmp_path.iterdir()] == [fresh.name]  # another process's conversion, under way
    remove_stale_temporaries(tmp_path)
    assert list(tmp_path.iterdir()) == []
