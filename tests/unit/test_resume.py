"""Checkpoints, exact resume, interrupts, early stopping."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from qatune.cli import cli
from qatune.errors import ConfigError, RunDirError
from qatune.train import TrainingInterrupted, train
from qatune.train import validation as validation_module
from qatune.train.checkpoint import find_checkpoint, list_checkpoints
from tests.conftest import interrupt_at, tiny_config

ROWS = [(f"question number {i}", f"answer {i % 5}") for i in range(12)]


def write_data(tmp_path):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in ROWS), encoding="utf-8")
    return data


def config_for(tmp_path, *overrides):
    return tiny_config(tmp_path, ROWS, "model.scratch.dropout=0.1", "train.epochs=3", "train.batch_size=2",
                       "train.gradient_accumulation_steps=2", "train.save_every=2", "train.learning_rate=3e-3",
                       "train.warmup_steps=2", "train.scheduler.gamma=0.5", *overrides)


def losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if line["event"] == "train"}


def test_resume_continues_exactly_where_it_stopped(tmp_path, monkeypatch):
    straight = train(config_for(tmp_path), output_dir=tmp_path / "straight", progress=False)
    interrupt_at(monkeypatch, 4)
    with pytest.raises(TrainingInterrupted) as err:
        train(config_for(tmp_path), output_dir=tmp_path / "stopped", progress=False)
    assert "training stopped by SIGINT at step 4 (in epoch 2)" in str(err.value)
    assert f"--resume {tmp_path / 'stopped'}" in str(err.value)
    assert json.loads((tmp_path / "stopped" / "run.json").read_text())["status"] == "stopped"
    assert find_checkpoint(tmp_path / "stopped").name == "step-0000004"
    monkeypatch.undo()
    resumed = train(config_for(tmp_path), output_dir=tmp_path / "stopped", resume="", progress=False)
    a, b = losses(straight), losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 10))      # 3 epochs x 3 steps, each step logged once
    assert a == b                                              # bit for bit, every logged loss
    final_a = load_file(straight / "final" / "model.safetensors")
    final_b = load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    assert json.loads((resumed / "run.json").read_text())["status"] == "complete"


def train_lines(run_dir):
    """Every training-loss line of metrics.jsonl, its timing field left out."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k != "tokens_per_s"} for line in lines if line["event"] == "train"]


@pytest.mark.parametrize("stop", [6, 3])
def test_a_logging_window_that_spans_the_interruption_logs_what_an_uninterrupted_run_logs(tmp_path, monkeypatch,
                                                                                          stop):
    # logging_steps 4: lines at steps 1, 4 and 8; a stop after step 6 falls inside the window of steps 5-8, one
    # after step 3 (the last of epoch 1, so the resumed process starts with the epoch's end) inside 2-4.
    config = config_for(tmp_path, "train.logging_steps=4", "train.device=cpu")
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

    config = config_for(tmp_path, "train.logging_steps=4")
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


def test_a_saved_logging_window_without_all_its_numbers_marks_the_checkpoint_damaged(tmp_path, monkeypatch):
    from qatune.runs import atomic
    from qatune.train.checkpoint import damage

    interrupt_at(monkeypatch, 6)
    with pytest.raises(TrainingInterrupted) as err:
        train(config_for(tmp_path, "train.logging_steps=4"), output_dir=tmp_path / "run", progress=False)
    checkpoint = err.value.checkpoint
    assert damage(checkpoint) is None
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["log_window"]["seconds"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    atomic.write_manifest(checkpoint)
    assert "log_window must be an object of the numbers ['loss_sum', 'items', 'tokens', 'seconds']" in damage(
        checkpoint)


def test_checkpoints_keep_the_last_k(tmp_path):
    run = train(config_for(tmp_path, "train.keep_checkpoints=2"), output_dir=tmp_path / "run", progress=False)
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
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for s in optimizer_state["state"].values())
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
        train(config_for(tmp_path), output_dir=tmp_path / "run", progress=False)
    names = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()]
    assert names == ["step-0000002"]                      # no half-written step-0000004, no temporary folder
    assert find_checkpoint(tmp_path / "run").name == "step-0000002"
    assert torch.serialization.get_crc32_options()         # restored after the failure too


def test_resume_ignores_a_temporary_folder_left_by_a_kill(tmp_path, monkeypatch):
    interrupt_at(monkeypatch, 2)
    with pytest.raises(TrainingInterrupted):
        train(config_for(tmp_path), output_dir=tmp_path / "run", progress=False)
    junk = tmp_path / "run" / "checkpoints" / ".tmp-step-0000003"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"partial")
    assert find_checkpoint(tmp_path / "run").name == "step-0000002"


def test_resume_refuses_a_changed_config_and_missing_checkpoints(tmp_path, monkeypatch):
    interrupt_at(monkeypatch, 2)
    with pytest.raises(TrainingInterrupted):
        train(config_for(tmp_path), output_dir=tmp_path / "run", progress=False)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"differs from the run being resumed in \['train.learning_rate'\]"):
        train(config_for(tmp_path, "train.learning_rate=1e-4"), output_dir=tmp_path / "run", resume="")
    with pytest.raises(RunDirError, match="nothing to resume"):
        train(config_for(tmp_path), output_dir=tmp_path / "empty", resume="")
    more = train(config_for(tmp_path, "train.epochs=4"), output_dir=tmp_path / "run", resume="", progress=False)
    assert max(losses(more)) == 12


def test_resume_refuses_epochs_that_would_end_the_run_without_training(tmp_path, caplog):
    run = train(config_for(tmp_path, "train.keep_checkpoints=9"), output_dir=tmp_path / "run", progress=False)
    end_of_1, in_2 = (run / "checkpoints" / f"step-{n:07d}" for n in (3, 4))   # 3 steps per epoch
    with pytest.raises(ConfigError) as err:
        train(config_for(tmp_path, "train.epochs=1"), resume=end_of_1, progress=False)
    assert str(err.value) == (f"the run stopped after epoch 1 of 3 (step 3, {end_of_1}); train.epochs 1 would end "
                              "it without training: resume with the run's own config (qatune train --resume "
                              f"{end_of_1}) or --set train.epochs to 2 or more")
    with pytest.raises(ConfigError, match=r"^the run stopped in epoch 2 of 3 \(step 4, .*\); train.epochs 1 would"):
        train(config_for(tmp_path, "train.epochs=1"), resume=in_2, progress=False)
    with pytest.raises(ConfigError, match=r"^the run stopped after epoch 3 of 3 \(step 9, .*\); train.epochs 2 would"):
        train(config_for(tmp_path, "train.epochs=2"), resume=run, progress=False)
    assert "epochs: 3" in (run / "config.yaml").read_text()
    # The end of the run's own last epoch (a run stopped before final/ was written): resuming finishes it.
    shutil.rmtree(run / "final")
    with caplog.at_level(logging.INFO, logger="qatune"):
        train(config_for(tmp_path), resume=run, progress=False)
    assert f"nothing left to train: {run / 'checkpoints' / 'step-0000009'} ends epoch 3 of 3" in caplog.text
    assert (run / "final" / "model.safetensors").is_file()
    assert json.loads((run / "run.json").read_text())["result"]["steps"] == 9


def test_the_stop_message_names_the_command_that_resumes(tmp_path):
    from qatune.train.checkpoint import TrainState

    checkpoint = tmp_path / "my runs" / "faq" / "checkpoints" / "step-0000005"
    one = TrainingInterrupted("SIGTERM", TrainState(step=5, epoch=1), checkpoint)
    assert str(one) == (f"training stopped by SIGTERM at step 5 (after epoch 1); checkpoint saved in {checkpoint}; "
                        f"resume with: qatune train --resume '{tmp_path / 'my runs' / 'faq'}'")
    two = TrainingInterrupted("SIGINT", TrainState(step=5, epoch=1, consumed=2), checkpoint, processes=2)
    assert str(two).startswith("training stopped by SIGINT at step 5 (in epoch 2);")
    assert str(two).endswith("--num-processes 2")


def test_existing_run_is_refused_without_overwrite(tmp_path):
    config = config_for(tmp_path, "train.epochs=1")
    train(config, output_dir=tmp_path / "run", progress=False)
    with pytest.raises(RunDirError, match="already holds a run; pass --overwrite"):
        train(config, output_dir=tmp_path / "run", progress=False)
    train(config, output_dir=tmp_path / "run", overwrite=True, progress=False)


def test_early_stopping(tmp_path, monkeypatch):
    scores = iter([50.0, 40.0, 45.0, 60.0])
    monkeypatch.setattr(validation_module, "metrics_from", lambda info, records, predictions, loss_sum, count: {
        "exact_match": 0.0, "f1": next(scores), "loss": 1.0, "perplexity": 2.7, "num_examples": len(records)})
    config = config_for(tmp_path, "train.epochs=4", "data.validation_fraction=0.25",
                        "train.early_stopping_patience=2")
    run = train(config, output_dir=tmp_path / "run", progress=False)
    status = json.loads((run / "run.json").read_text())
    assert status["result"]["best_eval"]["epoch"] == 1           # stopped after epochs 2 and 3 did not improve
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert len(evals) == 3
    assert (run / "best" / "model.safetensors").is_file() and (run / "final" / "model.safetensors").is_file()
    assert json.loads((find_checkpoint(run) / "trainer_state.json").read_text())["best_checkpoint"] == "step-0000003"


SLOW_CONFIG = """
model: {{scratch: {{n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 300}}}}
data: {{train_file: {data}}}
train: {{epochs: 200, batch_size: 2, save_every: 1, keep_checkpoints: 3, learning_rate: 1.0e-3}}
"""


def start_training(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(SLOW_CONFIG.format(data=write_data(tmp_path)), encoding="utf-8")
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "qatune", "train", "--config", str(config), "--output-dir",
                             str(run), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(list_checkpoints(run)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    return proc, config, run


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_only_loadable_checkpoints(tmp_path):
    proc, _, run = start_training(tmp_path)
    time.sleep(0.7)
    proc.kill()
    proc.wait()
    checkpoints = list_checkpoints(run)
    assert checkpoints
    for checkpoint in checkpoints:
        json.loads((checkpoint / "trainer_state.json").read_text())
        load_file(checkpoint / "model.safetensors")
        torch.load(checkpoint / "optimizer.pt", weights_only=True)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_cli_resumes(tmp_path):
    proc, config, run = start_training(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "training stopped by SIGTERM" in stderr and "--resume" in stderr
    assert "Traceback" not in stderr
    stopped = json.loads((find_checkpoint(run) / "trainer_state.json").read_text())
    assert json.loads((run / "run.json").read_text())["status"] == "stopped"
    # Resume and train to the end of the epoch after the one it stopped in: 12 rows / batch 2 = 6 steps each.
    epochs = stopped["epoch"] + 2
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--output-dir", str(run), "--resume",
                                      "--set", f"train.epochs={epochs}", "--quiet"])
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads((run / "run.json").read_text())["status"] == "complete"
    final = json.loads((find_checkpoint(run) / "trainer_state.json").read_text())
    assert (final["step"], final["epoch"]) == (6 * epochs, epochs)
    assert final["step"] > stopped["step"]


def test_a_checkpoint_is_pruned_by_renaming_it_away_before_deleting_it(tmp_path, monkeypatch):
    # A kill in the middle of deleting an old checkpoint must not leave a half-deleted step-N behind.
    import shutil

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
