"""--resume: exactly where the run stopped, logging windows included; what it refuses."""

import json
import logging
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

from qatune.errors import ConfigError, RunDirError
from qatune.train import TrainingInterrupted, train
from qatune.train.checkpoint import find_checkpoint
from tests.conftest import interrupt_at, resume_config


def losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if line["event"] == "train"}


def test_resume_continues_exactly_where_it_stopped(tmp_path, monkeypatch):
    straight = train(resume_config(tmp_path), output_dir=tmp_path / "straight", progress=False)
    interrupt_at(monkeypatch, 4)
    with pytest.raises(TrainingInterrupted) as err:
        train(resume_config(tmp_path), output_dir=tmp_path / "stopped", progress=False)
    assert "training stopped by SIGINT at step 4 (in epoch 2)" in str(err.value)
    assert f"--resume {tmp_path / 'stopped'}" in str(err.value)
    assert json.loads((tmp_path / "stopped" / "run.json").read_text())["status"] == "stopped"
    assert find_checkpoint(tmp_path / "stopped").name == "step-0000004"
    monkeypatch.undo()
    resumed = train(resume_config(tmp_path), output_dir=tmp_path / "stopped", resume="", progress=False)
    a, b = losses(straight), losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 10))      # 3 epochs x 3 steps, each step logged once
    assert a == b                                              # bit for bit, every logged loss
    final_a = load_file(straight / "final" / "model.safetensors")
    final_b = load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    assert json.loads((resumed / "run.json").read_text())["status"] == "complete"


def train_lines(run_dir):
    """Every training-loss line of metrics.jsonl, its measured fields (speed, the process's peak memory) left out."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in ("tokens_per_s", "peak_memory_mb", "rss_mb")} for line in lines
            if line["event"] == "train"]


@pytest.mark.parametrize("stop", [6, 3])
def test_a_logging_window_that_spans_the_interruption_logs_what_an_uninterrupted_run_logs(tmp_path, monkeypatch,
                                                                                          stop):
    # logging_steps 4: lines at steps 1, 4 and 8; a stop after step 6 falls inside the window of steps 5-8, one
    # after step 3 (the last of epoch 1, so the resumed process starts with the epoch's end) inside 2-4.
    config = resume_config(tmp_path, "train.logging_steps=4", "train.device=cpu")
    straight = train(config, output_dir=tmp_path / "straight", progress=False)
    interrupt_at(monkeypatch, stop)
    with pytest.raises(TrainingInterrupted):
        train(config, output_dir=tmp_path / "stopped", progress=False)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Detected call of `lr_scheduler.step")   # a false alarm
        resumed = train(config, output_dir=tmp_path / "stopped", resume="", progress=False)
    assert [line["step"] for line in train_lines(straight)] == [1, 4, 8]
    assert train_lines(resumed) == train_lines(straight)     # loss, lr, grad_norm, supervised_tokens: exact


def test_a_checkpoint_written_before_logging_windows_were_saved_resumes_with_an_empty_window(tmp_path, monkeypatch):
    from qatune.runs import atomic

    config = resume_config(tmp_path, "train.logging_steps=4")
    interrupt_at(monkeypatch, 6)
    with pytest.raises(TrainingInterrupted) as err:
        train(config, output_dir=tmp_path / "run", progress=False)
    monkeypatch.undo()
    checkpoint = err.value.checkpoint
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state.pop("log_window")["items"] > 0               # step 5 and 6 of the window 5-8
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    atomic.write_manifest(checkpoint)                         # as an older qatune wrote it
    run = train(config, output_dir=tmp_path / "run", resume="", progress=False)
    assert [line["step"] for line in train_lines(run)] == [1, 4, 8]
    assert json.loads((run / "run.json").read_text())["status"] == "complete"


def test_resume_refuses_a_changed_config_and_missing_checkpoints(tmp_path, monkeypatch):
    interrupt_at(monkeypatch, 2)
    with pytest.raises(TrainingInterrupted):
        train(resume_config(tmp_path), output_dir=tmp_path / "run", progress=False)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"differs from the run being resumed in \['train.learning_rate'\]"):
        train(resume_config(tmp_path, "train.learning_rate=1e-4"), output_dir=tmp_path / "run", resume="")
    with pytest.raises(RunDirError, match="nothing to resume"):
        train(resume_config(tmp_path), output_dir=tmp_path / "empty", resume="")
    more = train(resume_config(tmp_path, "train.epochs=4"), output_dir=tmp_path / "run", resume="", progress=False)
    assert max(losses(more)) == 12


def test_resume_refuses_epochs_that_would_end_the_run_without_training(tmp_path, caplog):
    run = train(resume_config(tmp_path, "train.keep_checkpoints=9"), output_dir=tmp_path / "run", progress=False)
    end_of_1, in_2 = (run / "checkpoints" / f"step-{n:07d}" for n in (3, 4))   # 3 steps per epoch
    with pytest.raises(ConfigError) as err:
        train(resume_config(tmp_path, "train.epochs=1"), resume=end_of_1, progress=False)
    assert str(err.value) == (f"the run stopped after epoch 1 of 3 (step 3, {end_of_1}); train.epochs 1 would end "
                              "it without training: resume with the run's own config (qatune train --resume "
                              f"{end_of_1}) or --set train.epochs to 2 or more")
    with pytest.raises(ConfigError, match=r"^the run stopped in epoch 2 of 3 \(step 4, .*\); train.epochs 1 would"):
        train(resume_config(tmp_path, "train.epochs=1"), resume=in_2, progress=False)
    with pytest.raises(ConfigError, match=r"^the run stopped after epoch 3 of 3 \(step 9, .*\); train.epochs 2 would"):
        train(resume_config(tmp_path, "train.epochs=2"), resume=run, progress=False)
    assert "epochs: 3" in (run / "config.yaml").read_text()
    # The end of the run's own last epoch (a run stopped before final/ was written): resuming finishes it.
    shutil.rmtree(run / "final")
    with caplog.at_level(logging.INFO, logger="qatune"):
        train(resume_config(tmp_path), resume=run, progress=False)
    assert f"nothing left to train: {run / 'checkpoints' / 'step-0000009'} ends epoch 3 of 3" in caplog.text
    assert (run / "final" / "model.safetensors").is_file()
    assert json.loads((run / "run.json").read_text())["result"]["steps"] == 9
