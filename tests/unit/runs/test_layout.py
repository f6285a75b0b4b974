"""The run directory: which model folder a path names, and what a run directory in the way says."""

import os

import pytest

from qatune.errors import RunDirError
from qatune.runs.layout import find_model_folder
from qatune.runs.lock import RunLock
from qatune.train import train
from tests.conftest import resume_config


def test_find_model_folder_errors(tmp_path):
    with pytest.raises(RunDirError, match="not found"):
        find_model_folder(tmp_path / "missing")
    with pytest.raises(RunDirError, match="not a qatune run directory"):
        find_model_folder(tmp_path)
    (tmp_path / "run.json").write_text('{"status": "failed"}')
    with pytest.raises(RunDirError, match=r"no final/ model \(run status: failed\); the run did not finish"):
        find_model_folder(tmp_path)
    (tmp_path / "run.json").write_text('{"status": "stopped"}')
    with pytest.raises(RunDirError, match=rf"continue it with qatune train --resume {tmp_path}, or pass a checkpoint"):
        find_model_folder(tmp_path)
    (tmp_path / "run.json").write_text('{"status": "complete"}')
    with pytest.raises(RunDirError, match=r"no best/ model: best/ is kept only when the run has validation data"):
        find_model_folder(tmp_path, "best")
    (tmp_path / "run.json").write_text('{"status": "running"}')
    with RunLock(tmp_path):  # this process trains there
        with pytest.raises(RunDirError, match=rf"{tmp_path} is still training \(qatune process {os.getpid()}, "):
            find_model_folder(tmp_path)
        (tmp_path / "run.json").write_text('{"status": "running", "data": {"validation": {"rows": 0}}}')
        with pytest.raises(RunDirError, match=r"no best/ model: best/ is kept only when the run has validation"):
            find_model_folder(tmp_path, "best")  # it never will have one
        (tmp_path / "run.json").write_text('{"status": "running"}')
    with pytest.raises(RunDirError, match="the run stopped before it finished \\(run status: running\\)"):
        find_model_folder(tmp_path)  # its process is gone


def test_existing_run_is_refused_without_overwrite(tmp_path):
    config = resume_config(tmp_path, "train.epochs=1")
    train(config, output_dir=tmp_path / "run", progress=False)
    with pytest.raises(RunDirError, match="already holds a run; pass --overwrite"):
        train(config, output_dir=tmp_path / "run", progress=False)
    train(config, output_dir=tmp_path / "run", overwrite=True, progress=False)
